"""The rollout engines as vLLM's trainer-side weight-transfer engines see them: a
`VLLMWeightSyncClient` whose four calls go to every engine through Ray and must come
back by a deadline of its phase, sized from the bytes it moves
(`rollout.sync_deadlines`). It lives in the actor's rank 0, which drives the transfer;
a call past its deadline fails the transfer with SyncDeadlineMissed, naming the engines
still in it (rank and pool), the phase and the bytes moved, and which engines do not
answer at all and which wait for them (`cluster.hangs`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import NoAnswer
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.rollout.sync_deadlines import Stall, SyncClock
from rlhf_trainer.rollout.weight_sync import EngineFanOut
from rlhf_trainer.worker import RENDEZVOUS_TIMEOUT


def phase_ceiling_s(timeout_s: float) -> float:
    """The longest a phase of a sync may take: the job's timeout, and a minute less than
    the actor's other ranks wait for rank 0 in a gather (their process group's timeout),
    so that a stalled engine is named and replaced rather than the actor's group lost."""
    return min(timeout_s, RENDEZVOUS_TIMEOUT.total_seconds() - 60)


@dataclass(frozen=True)
class Sent:
    """A call sent to every engine: its futures, the bytes it moves, when it was sent."""

    method: str
    calls: list[Any]
    nbytes: int
    at: float


class EngineGroupClient(EngineFanOut):
    """vLLM's `VLLMWeightSyncClient`, fanned out to the rollout group's engines."""

    def __init__(self, engines: WorkerGroup, timeout_s: float, workers_per_engine: int) -> None:
        # Without the driver's futures of the group (`ready`): only the handles travel.
        self.engines = WorkerGroup(engines.role, engines.slots, engines.hosts, [], engines.ranks)
        self.timeout_s = timeout_s
        self.workers_per_engine = workers_per_engine
        self.clock = SyncClock(ceiling_s=phase_ceiling_s(timeout_s))

    @property
    def engine_count(self) -> int:
        return self.engines.world_size

    def submit(self, method: str, *args: Any) -> Sent:
        calls = self.engines.run(method, *args, phase=Phase.SYNC_WEIGHTS)
        return self._sent(method, args, calls)

    def submit_each(self, method: str, firsts: Sequence[Any]) -> Sent:
        calls = self.engines.run_each(method, firsts, phase=Phase.SYNC_WEIGHTS)
        return self._sent(method, (firsts[0],) if firsts else (), calls)

    def _sent(self, method: str, args: tuple[Any, ...], calls: list[Any]) -> Sent:
        nbytes = self.clock.sent(method, args, self.push_bytes)
        return Sent(method, calls, nbytes, time.monotonic())

    def answers(self, sent: Sent) -> None:
        """Every engine's answer, by the call's deadline (from when the engines could
        begin it: calls are answered in the order sent)."""
        began = self.clock.begins(sent.at)
        deadline_s = self.clock.deadline_s(sent.method, sent.nbytes)
        try:
            join(sent.calls, max(0.0, began + deadline_s - time.monotonic()))
        except NoAnswer as error:
            raise self._missed(sent, deadline_s, error) from None
        except Exception as error:
            failed = ", ".join(self._failed(sent.calls)) or "an engine"
            raise TransferFailed(
                f"weight transfer, {sent.method}: {failed} failed: {error}"
            ) from error
        self.clock.answered(sent.method, sent.nbytes, began, time.monotonic())

    def _missed(self, sent: Sent, deadline_s: float, error: NoAnswer) -> SyncDeadlineMissed:
        """The engines still in `sent` past its deadline, the phase and the bytes."""
        import ray

        pending = {ref.binary() for ref in ray.wait(sent.calls, num_returns=len(sent.calls),
                                                    timeout=0)[1]}  # fmt: skip
        ranks = [rank for rank, call in zip(self.engines.ranks, sent.calls, strict=True)
                 if call.binary() in pending] or list(self.engines.ranks)  # fmt: skip
        stall = self.clock.stall(self.engines.pool, ranks, sent.method)
        return deadline_missed(sent.method, stall, deadline_s, sent.nbytes, str(error))

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


def deadline_missed(
    method: str, stall: Stall, deadline_s: float, nbytes: int, detail: str
) -> SyncDeadlineMissed:
    """The error of a call to the engines past its phase's deadline (`detail`: who
    answers at all, and who waits for them)."""
    sized = f"its deadline {deadline_s:g} s, for {nbytes} bytes"
    return SyncDeadlineMissed(
        f"weight transfer, {method} on every engine: {stall} ({sized}). {detail}"
    )


class SyncDeadlineMissed(NoAnswer):
    """Engines did not finish a phase of a weight sync by its deadline; the message
    names them (rank, pool), the phase and the bytes moved (`sync_deadlines.Stall`)."""
