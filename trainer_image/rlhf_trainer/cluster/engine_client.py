"""The rollout engines as vLLM's trainer-side weight-transfer engines see them: a
`VLLMWeightSyncClient` whose four calls go to every engine through Ray and must come
back within a timeout. It lives in the actor's rank 0, which drives the transfer; a
call that runs out fails the transfer, naming the engines that did not answer and
those still waiting (`cluster.hangs`), rank and pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import NoAnswer
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.rollout.weight_sync import EngineFanOut


class EngineGroupClient(EngineFanOut):
    """vLLM's `VLLMWeightSyncClient`, fanned out to the rollout group's engines."""

    def __init__(self, engines: WorkerGroup, timeout_s: float, workers_per_engine: int) -> None:
        # Without the driver's futures of the group (`ready`): only the handles travel.
        self.engines = WorkerGroup(engines.role, engines.slots, engines.hosts, [], engines.ranks)
        self.timeout_s = timeout_s
        self.workers_per_engine = workers_per_engine

    @property
    def engine_count(self) -> int:
        return self.engines.world_size

    def submit(self, method: str, *args: Any) -> tuple[str, list[Any]]:
        return method, self.engines.run(method, *args, phase=Phase.SYNC_WEIGHTS)

    def submit_each(self, method: str, firsts: Sequence[Any]) -> tuple[str, list[Any]]:
        return method, self.engines.run_each(method, firsts, phase=Phase.SYNC_WEIGHTS)

    def answers(self, sent: tuple[str, list[Any]]) -> None:
        method, calls = sent
        try:
            join(calls, self.timeout_s)
        except NoAnswer as error:
            raise NoAnswer(f"weight transfer, {method} on every engine: {error}") from None
        except Exception as error:
            failed = ", ".join(self._failed(calls)) or "an engine"
            raise TransferFailed(f"weight transfer, {method}: {failed} failed: {error}") from error

    def _failed(self, calls: list[Any]) -> list[str]:
        """The engines whose call has ended in an error, as 'rollout rank R on pool P'."""
        import ray

        ended = {ref.binary() for ref in ray.wait(calls, num_returns=len(calls), timeout=0)[0]}
        failed = []
        for rank, call in zip(self.engines.ranks, calls, strict=True):
            if call.binary() in ended:
                try:
                    ray.get(call)
                except Exception:
                    pool = self.engines.pool
                    failed.append(f"{self.engines.role.value} rank {rank} on pool {pool}")
        return failed


class TransferFailed(RuntimeError):
    """An engine's part of a weight transfer failed (its process died, say)."""
