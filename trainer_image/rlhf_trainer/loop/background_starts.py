"""Fully async's rollout engines starting in the background: in the bundles of lost
ones, on GPUs that joined the pool, and again in the slots of those that could not
start. The membership (`loop.membership`) takes them in at a weight sync once up."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import PlacementPlan
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.placement import PlacementTimeout, WorkerSlot
from rlhf_trainer.cluster.role_groups import WorkerSpec

log = logging.getLogger(__name__)

# Engines that could not start are started again in their slots after this, doubled
# at each failure in a row, up to the most: a node that cannot hold one (a broken GPU,
# an image that will not pull) costs a try now and then, not a busy loop or the run.
START_RETRY_S = 30.0
START_RETRY_MAX_S = 600.0


def start_retry_delay(failures: int) -> float:
    """Seconds to wait before starting engines again after `failures` failures in a row."""
    return float(min(START_RETRY_MAX_S, START_RETRY_S * 2 ** (failures - 1)))


@dataclass(frozen=True)
class StartRetry:
    """Slots whose engines could not start, to start again once `due` (monotonic s)."""

    slots: tuple[WorkerSlot, ...]
    due: float


class StartingPool(Protocol):
    """What starting engines needs of RoleGroups (a fake in tests/unit)."""

    def respawn(
        self, role: Role, slots: Sequence[WorkerSlot], worker: WorkerSpec
    ) -> list[WorkerGroup]: ...
    def start_more(
        self, plan: PlacementPlan, role: Role, worker: WorkerSpec
    ) -> WorkerGroup | None: ...
    def start_ended(self, group: WorkerGroup) -> bool: ...
    def start_error(self, group: WorkerGroup) -> Exception | None: ...


class BackgroundStarts:
    """The engines starting, and those waiting to start again."""

    def __init__(self, pool: StartingPool, plan: PlacementPlan, worker: WorkerSpec) -> None:
        self.pool = pool
        self.plan = plan
        self.worker = worker
        self.joining: list[WorkerGroup] = []  # starting
        self.retries: list[StartRetry] = []  # could not start, to start again
        self.failures: dict[tuple[WorkerSlot, ...], int] = {}  # in a row, by slots

    def add(self, groups: Sequence[WorkerGroup]) -> None:
        self.joining.extend(groups)
        for group in groups:
            log.info("rollout rank(s) %s starting in the background on pool %s",
                     list(group.ranks), group.pool)  # fmt: skip

    def count(self) -> int:
        """Engines starting or to start again."""
        starting = sum(group.world_size for group in self.joining)
        return starting + sum(len(retry.slots) for retry in self.retries)

    def more(self) -> list[WorkerGroup]:
        """Engines started on the pool's free GPUs, if there are any (not yet added)."""
        try:
            more = self.pool.start_more(self.plan, Role.ROLLOUT, self.worker)
        except PlacementTimeout as error:  # Ray gave them to a lost engine's bundle first
            log.warning("%s: the free GPUs were taken meanwhile", error)
            return []
        return [more] if more is not None else []

    def up(self) -> WorkerGroup | None:
        """The engines whose start ended well, as one group (None if none did); those
        whose start failed wait to start again (`StartRetry`)."""
        ended = [group for group in self.joining if self.pool.start_ended(group)]
        self.joining = [group for group in self.joining if group not in ended]
        started = [group for group in ended if self.started(group)]
        return functools.reduce(WorkerGroup.joined, started) if started else None

    def retried(self) -> list[WorkerGroup]:
        """Engines started again in the slots of those whose wait is over (not yet
        added)."""
        now = time.monotonic()
        due = [retry for retry in self.retries if retry.due <= now]
        self.retries = [retry for retry in self.retries if retry.due > now]
        return [group for retry in due
                for group in self.pool.respawn(Role.ROLLOUT, retry.slots, self.worker)]  # fmt: skip

    def started(self, group: WorkerGroup) -> bool:
        """Whether the engines of `group` (whose start has ended) are up. If not, they
        are shut down, and started again in their slots after a wait (`StartRetry`)."""
        error = self.pool.start_error(group)
        if error is None:
            self.failures.pop(group.slots, None)
            return True
        failures = self.failures.get(group.slots, 0) + 1
        self.failures[group.slots] = failures
        delay = start_retry_delay(failures)
        group.shutdown(grace_s=0)
        self.retries.append(StartRetry(group.slots, time.monotonic() + delay))
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        log.warning("rollout rank(s) %s could not start on pool %s (%s); starting again in "
                    "their slots in %.0f s", list(group.ranks), group.pool, reason,
                    delay)  # fmt: skip
        return False
