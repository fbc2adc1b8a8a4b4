"""The rollout role of synchronous PPO: a vLLM engine that generates a batch at a time."""

from __future__ import annotations

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import model_path
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.worker import RankInfo, Worker


class RolloutWorker(Worker):
    """A vLLM engine. It needs no process group of its own (vLLM makes its own)."""

    needs_process_group = False

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.config = config
        generation = config.generation
        self.engine = RolloutEngine(
            model_path(config.models.actor, config.trainer.seed),
            max_model_len=config.data.max_prompt_length + config.data.max_response_length,
            gpu_memory_utilization=generation.gpu_memory_utilization,
            tensor_parallel_size=generation.tensor_parallel_size,
            seed=config.trainer.seed,
        )

    def generate(self, prompts: list[list[int]], step: int) -> list[Rollout]:
        generation = self.config.generation
        # A seed per step and rank: a resumed run samples what the first one would have.
        seed = (self.config.trainer.seed * 1_000_003 + step) * 1_009 + self.info.rank * 100_003
        return self.engine.generate(
            prompts,
            max_tokens=self.config.data.max_response_length,
            temperature=generation.temperature,
            top_p=generation.top_p,
            seed=seed % 2**31,
        )

    def load_weights(self, payload: bytes, version: int) -> None:
        self.engine.load_serialized_weights(payload, version)

    def close(self) -> None:
        self.engine.shutdown()
