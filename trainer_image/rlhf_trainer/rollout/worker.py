"""The rollout role of synchronous PPO: a vLLM engine that generates a batch at a time."""

from __future__ import annotations

from dataclasses import asdict

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import model_path
from rlhf_trainer.rollout.engine import EngineOptions, RolloutEngine
from rlhf_trainer.worker import RankInfo, Worker, derive_seed


class RolloutWorker(Worker):
    """A vLLM engine. It needs no process group of its own (vLLM makes its own)."""

    needs_process_group = False

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.config = config
        self.engine = RolloutEngine(
            model_path(config.models.actor, config.trainer.seed),
            **asdict(EngineOptions.of(config)),
        )

    def generate(self, prompts: list[list[int]], step: int) -> list[Rollout]:
        generation = self.config.generation
        return self.engine.generate(
            prompts,
            max_tokens=self.config.data.max_response_length,
            temperature=generation.temperature,
            top_p=generation.top_p,
            # Per step and rank: a resumed run samples what the first one would have.
            seed=derive_seed(self.config.trainer.seed, "generate", step, self.info.rank),
        )

    def load_weights(self, payload: bytes, version: int) -> None:
        self.engine.load_serialized_weights(payload, version)

    def close(self) -> None:
        self.engine.shutdown()
