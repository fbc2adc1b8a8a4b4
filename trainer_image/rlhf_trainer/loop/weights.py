"""How new policy weights reach the rollout engines, in both modes: through vLLM's
weight-transfer API. The actor's rank 0 drives it (`Actor.send_weights`): it starts an
update on every engine, hands them the weights bucket by bucket, and finishes the
update with the new version; the engines pause meanwhile and resume on the new weights.

    actor rank 0 ──buckets (shared memory, gloo; NCCL or CUDA IPC on GPUs)──▶ engines
         └──── start / update / finish (Ray calls: cluster.engine_client) ────▶

The transfer is set up once, at the start of a run. The actor's other ranks take part
only in gathering each tensor whole (an FSDP collective).

No silent hangs: each phase of a sync (init, start, each bucket, finish) has a deadline
sized from the bytes it moves, at most `timeout_s` (`rollout.sync_deadlines`); past it
the actor's rank 0 fails the push naming the engines still in it, the phase and the
bytes moved, and the driver hands those engines back as lost (EnginesStalled), to
replace. The transfer's own collectives wait longer (`group_timeout_s`), so that the
calls, which can tell a stopped rank from its waiting peers, are what report; the
driver waits longer still. After a push that failed (an engine lost in it), an engine
that cannot close the update is stuck in the push's receive, as NCCL's is for ever: it
is handed back as lost (EnginesStuck), to replace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.engine_client import EngineGroupClient
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import RanksLost
from rlhf_trainer.cluster.role_groups import RoleGroups
from rlhf_trainer.cluster.waits import join, unfinished_after
from rlhf_trainer.rollout.sync_deadlines import PHASES, Stall
from rlhf_trainer.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    TransferSetup,
    agreed_transfer,
)

log = logging.getLogger(__name__)


def group_timeout_s(timeout_s: float) -> float:
    """How long the transfer's collectives wait: well past the engine calls' own wait."""
    return 2 * timeout_s + 60


class EnginesStalled(RanksLost):
    """Rollout engines that did not finish a phase of a weight sync by its deadline
    (`sync_deadlines.Stall`): hung, or too slow to serve. They are replaced as lost
    ones are, and counted against generation.maxEngineRestarts (a stall that comes
    back in the same bundle ends the run rather than loop)."""

    def __init__(self, stall: Stall) -> None:
        super().__init__(Role.ROLLOUT, stall.pool, stall.ranks)
        self.stall = stall
        self.args = (f"{stall}: replaced as lost",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (EnginesStalled, (self.stall,))


@dataclass(frozen=True)
class SyncFailure:
    """A weight sync that failed: its phase (init, start, bucket, finish; "other" when
    the error does not say) and a line for the log, built from names and counts only."""

    phase: str
    line: str

    @classmethod
    def of(cls, error: BaseException) -> SyncFailure:
        if (stall := Stall.found_in(error)) is not None:
            return cls(stall.phase, str(stall))
        text = str(error)
        said = [(text.find(method), phase) for method, phase in PHASES.items() if method in text]
        phase = min(said)[1] if said else "other"
        return cls(phase, f"a weight sync failed in its {phase} phase ({type(error).__name__})")


class EnginesStuck(RanksLost):
    """Rollout engines that live but are stuck in the weight transfer: after a failed
    push they did not close its update within the engine calls' timeout. A vLLM
    worker waiting in an NCCL receive whose sender aborted waits for ever (NCCL tells
    no peer of an abort, and nothing outside its process can end the receive), so such
    an engine can only be replaced, as a lost one is; it is not counted against
    generation.maxEngineRestarts (`EngineMembership.count_lost`)."""

    def __init__(self, pool: str, ranks: Sequence[int], timeout_s: float) -> None:
        super().__init__(Role.ROLLOUT, pool, ranks)
        names = ", ".join(f"rollout rank {rank}" for rank in self.ranks)
        self.args = (f"{names} on pool {pool} stuck in the weight transfer: no answer "
                     f"within {timeout_s:g} s to closing a failed push's update",)  # fmt: skip


class WeightSync:
    """The driver's side of the weight transfer between the actor and the rollout pool:
    the engines that serve are those `groups` holds (one place for who serves, which a
    loss or a join changes before the transfer is set up again: `reopen`)."""

    def __init__(
        self,
        groups: RoleGroups,
        timeout_s: float,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.groups = groups
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.opened = False
        self.actor_version = 0  # the actor's weights: bumped after each of its updates
        self.served = 0  # the version the last push that completed handed the engines
        # Engine calls the next push waits for (an evaluation): an engine busy in one
        # would take the push's calls only after it, and be taken for a hung rank.
        self.engines_busy: list[tuple[list[Any], float]] = []  # (calls, their timeout)
        self.failures: list[SyncFailure] = []  # since `take_failures`

    @property
    def actor(self) -> WorkerGroup:
        return self.groups[Role.ACTOR]

    @property
    def rollout(self) -> WorkerGroup:
        """The engines that serve."""
        return self.groups[Role.ROLLOUT]

    def open(self) -> None:
        """Set up the transfer: the actor's rank 0 and every engine, on the backend the
        engines were built with (`api.transfer.choose_transfer`); a transfer open
        before is shut down first, on both sides (`Actor.open_weight_transfer`)."""
        with self.failing():
            self._open()

    def _open(self) -> None:
        sender = self.actor.hosts[0]
        (host, port), where = join(
            [sender.rendezvous_address.remote(), sender.whereabouts.remote()]
        )  # fmt: skip
        engines = join([engine.whereabouts.remote() for engine in self.rollout.hosts])
        built = agreed_transfer(join(self.rollout.run("weight_transfer")), self.rollout.ranks)
        remote = tuple(
            rank for rank, e in zip(self.rollout.ranks, engines, strict=True)
            if e.node_id != where.node_id
        )  # fmt: skip
        setup = TransferSetup(
            host, port, self.rollout.world_size, remote, self.bucket_bytes,
            group_timeout_s(self.timeout_s), built.backend, built.workers,
        )  # fmt: skip
        client = EngineGroupClient(self.rollout, self.timeout_s, built.workers)
        join(self.actor.run("open_weight_transfer", setup, client), self.driver_wait_s)
        self.opened = True

    @property
    def driver_wait_s(self) -> float:
        """How long the driver waits for the actor's side: past the collectives' wait."""
        return group_timeout_s(self.timeout_s) + self.timeout_s

    def push(self, version: int) -> None:
        """Hand the actor's weights to every engine as `version`; returns once they all
        serve it. A paused engine stays paused."""
        if not self.opened:
            raise RuntimeError("the weight sync is not open (call open first)")
        self.wait_for_engines()
        with self.failing():
            sends = self.actor.run("send_weights", version, phase=Phase.SYNC_WEIGHTS)
            join(sends, self.driver_wait_s)
        self.served = version

    @contextmanager
    def failing(self) -> Iterator[None]:
        """A sync's failure is recorded (`take_failures`); a missed deadline is raised
        as EnginesStalled, naming the engines to replace, the phase and the bytes."""
        try:
            yield
        except Exception as error:
            self.failures.append(SyncFailure.of(error))
            if (stall := Stall.found_in(error)) is not None:
                raise EnginesStalled(stall) from error
            raise

    def take_failures(self) -> list[SyncFailure]:
        """The syncs that failed since the last call."""
        failures, self.failures = self.failures, []
        return failures

    def wait_for_engines(self) -> None:
        """Wait for the calls the engines are busy in (an evaluation): the transfer's
        calls would queue behind them and be taken for a hung engine's. Past their own
        timeout: NoAnswer, naming the engines stuck in them."""
        started = time.monotonic()
        for calls, timeout_s in self.engines_busy:
            join(calls, timeout_s)
        self.engines_busy = []  # only now: one lost in them is forgotten (Evaluator.forget)
        if time.monotonic() - started > 1.0:
            log.info("the weight transfer waited %.1f s for the engines' evaluation",
                     time.monotonic() - started)  # fmt: skip

    def reopen(self) -> None:
        """Set the transfer up again for the engines that serve now: those that go on
        after some were lost, or with some that joined (the NCCL group regrouped: each
        engine's ranks follow the ones before it). An update a failed push left open on
        them is closed unserved first (paused until the next push: never half loaded),
        and the old transfer is shut down on both sides. The engines keep the weights
        they serve. Engines that cannot close it within the timeout, still in the
        failed push's receive, are raised as EnginesStuck (the transfer is not opened)."""
        self.wait_for_engines()  # the calls below would queue behind theirs
        closing = self.rollout.run("abandon_weight_update")
        if stuck := unfinished_after(closing, self.timeout_s):
            ranks = [self.rollout.ranks[i] for i in stuck]
            raise EnginesStuck(self.rollout.pool, ranks, self.timeout_s)
        join(closing)
        self.open()

    def wait_before_next_push(self, calls: list[Any], timeout_s: float) -> None:
        """Let the engines finish `calls` (within `timeout_s`) before the next push."""
        self.engines_busy.append((calls, timeout_s))

    def forget_busy(self, calls: list[Any]) -> None:
        """Wait no more for `calls` (those of engines lost: they will never answer)."""
        forgotten = {call.binary() for call in calls}
        self.engines_busy = [
            ([c for c in busy if c.binary() not in forgotten], timeout_s)
            for busy, timeout_s in self.engines_busy
        ]
