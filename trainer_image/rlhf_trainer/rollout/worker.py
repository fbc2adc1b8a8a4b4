"""The rollout role's workers: one vLLM engine per rank, which takes the actor's
weights over the sync group (`weight_sync`). `RolloutWorker` generates a batch at a
time (synchronous PPO); `streaming.StreamingRollout` streams (fully async)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import model_path
from rlhf_trainer.rollout.engine import EngineOptions, RolloutEngine
from rlhf_trainer.rollout.weight_sync import SyncGroup, WeightSpec, open_sync_group, receive_copies
from rlhf_trainer.telemetry.engine_stats import EngineStats, read_engine_stats
from rlhf_trainer.worker import RankInfo, Worker, derive_seed


class EngineWorker(Worker):
    """A vLLM engine built from the spec, and the receiving end of the weight sync.
    It needs no process group of its own (vLLM makes its own)."""

    needs_process_group = False

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.config = config
        self.engine = RolloutEngine(
            model_path(config.models.actor, config.trainer.seed),
            **asdict(EngineOptions.of(config)),
            name=f"rollout rank {info.rank} (pool {info.pool})",
        )
        self.sync_group: SyncGroup | None = None

    def open_weight_sync(
        self, host: str, port: int, world_size: int, device: str, timeout_s: float
    ) -> None:
        """Join the weight-sync group as rank 1 + this engine's rank (the actor's rank 0
        is rank 0). `device`: see `weight_sync.sync_device`; `timeout_s`: how long its
        collectives may wait."""
        rank = 1 + self.info.rank
        self.sync_group = open_sync_group(host, port, rank, world_size, device, timeout_s)

    def receive_weights(self, specs: Sequence[WeightSpec], bucket_bytes: int, version: int) -> None:
        """Take the new weights from the broadcast into the engine. A paused engine
        stays paused (fully async resumes it later); a running one pauses meanwhile.
        An engine that died is restarted with them (the broadcast reaches this process,
        not vLLM's, so it never misses one)."""
        assert self.sync_group is not None, "open_weight_sync first"
        # The engine's model lives in its own process, so the weights are loaded in one
        # go after the broadcast.
        self.engine.load_weights(receive_copies(self.sync_group, specs, bucket_bytes), version)

    def evaluate(self, prompts: list[list[int]], step: int) -> list[Rollout]:
        """One response per prompt, sampled as generation.eval says, on the weights the
        engine has now. Beside any other requests (fully async goes on generating), but
        it holds this worker: the next weights load only after it (one version)."""
        sampling = self.config.generation.eval
        seed = derive_seed(self.config.trainer.seed, "eval", step, self.info.rank)

        async def answer_all() -> list[Rollout]:
            answers = (
                self.engine.generate(
                    f"eval-{step}-{i}",
                    prompt,
                    max_tokens=self.config.data.max_response_length,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    seed=seed + i,
                )
                for i, prompt in enumerate(prompts)
            )
            return list(await asyncio.gather(*answers))

        return self.engine.call(answer_all())

    def engine_stats(self) -> EngineStats | None:
        """The engine's vLLM stats and restarts. Safe from any thread, at any time: it
        reads metric values in this process and never waits for the engine."""
        engine: RolloutEngine | None = getattr(self, "engine", None)  # None: being built
        return read_engine_stats() if engine is None else engine.stats()

    def close(self) -> None:
        self.engine.shutdown()
        if self.sync_group is not None:
            self.sync_group.close()


class RolloutWorker(EngineWorker):
    """Synchronous PPO's rollout rank: generates the batch it is given."""

    def generate(self, prompts: list[list[int]], step: int, attempt: int = 0) -> list[Rollout]:
        """One response per prompt. `attempt` > 0: dynamic sampling's further rounds
        of the step, seeded apart from the first. If the engine dies, it is restarted
        and the batch generated again with the same seeds: the same samples (nothing
        of the step was trained yet); past `generation.maxEngineRestarts` this raises
        EngineRestartsExhausted, naming the rank and pool."""
        generation = self.config.generation
        purpose = "generate" if attempt == 0 else f"generate-round-{attempt}"
        return self.engine.generate_batch(
            prompts,
            max_tokens=self.config.data.max_response_length,
            temperature=generation.temperature,
            top_p=generation.top_p,
            # Per step and rank: a resumed run samples what the first one would have.
            seed=derive_seed(self.config.trainer.seed, purpose, step, self.info.rank),
        )
