"""Fully async's rollout engines as they come and go: a rollout pod or node lost, or
nodes that join the pool (a bigger `replicas`, a replacement pod).

- Lost (its vLLM engine died, or its process or node is gone: `engine_death`): the
  engine is dropped, an update a failed push left open on the others is closed
  unserved, the weight transfer set up again for them, and what the lost one still
  owed is admitted to them again. With none left, the run waits for the new ones
  started in the lost ones' bundles, and pushes them the current weights.
  `EngineLedger` knows which engine holds which prompt; the queue knows which uids
  have arrived (`SampleQueue.not_received`), and keeps a uid once, so a late answer
  from the lost engine is not trained twice. The staleness bound holds: what is
  admitted again starts on the current policy.
- Joined: GPUs of the pool that no placement group holds get engines, and so does the
  bundle of a lost engine (Ray places it again, on the node that replaces a lost one).
  They start in the background; the trainer takes them in at a weight sync once they
  are up, before its push, so they serve the current policy from their first prompt.

The trainer asks at its own moments (between its calls to the engines). This module
keeps the membership in one place: who serves (the group, which RoleGroups holds and
the weight transfer reads), who is starting or waits to start again, what each engine
was given (the ledger, and the admissions not yet acknowledged), and the counts.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.api.config import Role
from rlhf_trainer.cluster.groups import WorkerGroup, started_up
from rlhf_trainer.cluster.hangs import RanksLost
from rlhf_trainer.cluster.placement import PlacementTimeout, WorkerSlot
from rlhf_trainer.cluster.role_groups import PLACEMENT_TIMEOUT_S
from rlhf_trainer.cluster.waits import finished, join
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import PPOTrainer, split_list
from rlhf_trainer.loop.weights import EnginesStuck
from rlhf_trainer.rollout.queue import Admitted

log = logging.getLogger(__name__)

# The timeline's marks of the rollout pool changing: the spans of the work it took.
ENGINES_LOST, ENGINES_JOINED = "engines_lost", "engines_joined"
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


class EngineLedger:
    """Which engine (by its rank) was given which prompt, until the trainer takes it."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, Admitted]] = {}  # uid -> (engine rank, admitted)

    def assign(self, ranks: Sequence[int], shards: Sequence[Sequence[Admitted]]) -> None:
        """Engine ranks[i] was given shards[i]."""
        for rank, shard in zip(ranks, shards, strict=True):
            for admitted in shard:
                self._held[admitted[0]] = (rank, admitted)

    def taken(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self._held.pop(uid, None)

    def held_by(self, ranks: Iterable[int]) -> list[int]:
        """The uids given to the engines of `ranks` and not taken yet, in order."""
        lost = set(ranks)
        return sorted(uid for uid, (rank, _) in self._held.items() if rank in lost)

    def admitted(self, uids: Iterable[int]) -> list[Admitted]:
        """What admitted `uids`, to give them to other engines."""
        return [self._held[uid][1] for uid in uids]

    def __len__(self) -> int:
        return len(self._held)


class ElasticRollout:
    """The rollout group of a fully-async run as its engines are lost and join."""

    def __init__(self, core: PPOTrainer, parts: RunParts) -> None:
        self.core = core
        self.queue = parts.queue  # the SampleQueue actor
        self.metrics = parts.metrics
        self.worker = parts.engines.worker  # the engines' (a toy engine's in tests)
        self.ledger = EngineLedger()
        # The admissions given since the last wait, by engine rank: the trainer goes on
        # without waiting for them, and waits before its next sync.
        self.admissions: list[tuple[int, Any]] = []
        self.joining: list[WorkerGroup] = []  # engines starting in the background
        self.retries: list[StartRetry] = []  # engines that could not start, to start again
        self.start_failures: dict[tuple[WorkerSlot, ...], int] = {}  # in a row, by slots
        # Told the ranks of engines lost, once the others are the group (the evaluation
        # asks them again what the lost ones were answering).
        self.on_lost: list[Callable[[Sequence[int]], None]] = []
        self.count()

    @property
    def group(self) -> WorkerGroup:
        """The engines that serve."""
        return self.core.groups[Role.ROLLOUT]

    def dead(self) -> RanksLost | None:
        """The engines that died since the last look, if any."""
        dead = self.group.dead_ranks()
        return RanksLost(Role.ROLLOUT, self.group.pool, dead) if dead else None

    def lose(self, lost: RanksLost) -> list[Admitted]:
        """Go on without the engines of `lost`, and without any more that die while
        that is done: in rounds, until a round ends with every engine that serves alive.
        Engines the loss left stuck in the weight transfer (EnginesStuck) go too. Past
        generation.maxEngineRestarts, EngineRestartsExhausted naming them. Returns
        what they owed (to admit again); their admissions are no longer waited for."""
        gone: list[int] = []
        dying: RanksLost | None = lost
        unloaded: list[int] = []  # lost with none serving: their replacements need weights
        with self.core.timeline.span(self.group.pool, Role.ROLLOUT, ENGINES_LOST):
            while dying is not None:
                self.core.engines.count(dying)
                gone += dying.ranks
                if not self.drop(list(dying.ranks)):
                    unloaded += dying.ranks
                try:
                    self.core.weight_sync.reopen()
                    if unloaded:
                        self.core.weight_sync.push(self.core.policy_version)
                        self.tell(unloaded)
                        unloaded = []
                except EnginesStuck as stuck:  # left in the failed push's receive (NCCL)
                    log.warning("%s: they go too", stuck)
                    dying = stuck
                    continue
                except Exception:  # a call met one more that died (or stopped)
                    if (dying := self.dead()) is None:
                        raise
                    continue
                dying = self.dead()
            owed = join([self.queue.not_received.remote(self.ledger.held_by(gone))])[0]
        self.admissions = [(rank, call) for rank, call in self.admissions if rank not in gone]
        log.warning("%s: going on with %d engine(s); %d sample(s) they owed are generated "
                    "again on them", RanksLost(Role.ROLLOUT, self.group.pool, gone),
                    self.group.world_size, len(owed))  # fmt: skip
        self.count()
        self.metrics.samples_readmitted.inc(len(owed))
        return self.ledger.admitted(owed)

    def give(self, admitted: list[Admitted]) -> None:
        """Give `admitted` to the engines that serve, in even shards, noting which
        engine holds which. An engine runs its calls in order, so no admission waits
        for another."""
        if not admitted:
            return
        group = self.group
        shards = split_list(admitted, group.world_size)
        self.ledger.assign(group.ranks, shards)
        self.admissions += zip(group.ranks, group.run_each("admit", shards), strict=True)

    def wait_for_admissions(self, timeout_s: float) -> None:
        """Wait for the admissions since the last wait (they return at once); raises
        what an engine that died in one raised, keeping the others to wait for."""
        join([call for _, call in self.admissions], timeout_s)
        self.admissions = []

    def drop(self, ranks: list[int]) -> bool:
        """The engines of `ranks` out of the group, for good (one that only stopped
        answering must not come back and generate), and new ones started in their
        slots. Whether others serve: then those who listen are told. With none left,
        the new ones serve once up (waited for here), and need the current weights."""
        before = self.group
        serving = before.without(ranks)
        gone = before.without(serving.ranks)
        gone.shutdown(grace_s=0)
        started = self.core.groups.respawn(Role.ROLLOUT, gone.slots, self.worker)
        if serving.world_size == 0:  # nothing can generate meanwhile: wait for them
            log.warning("%s: no engine serves; waiting for those started in their bundles",
                        RanksLost(Role.ROLLOUT, before.pool, ranks))  # fmt: skip
            self.core.groups.replace(started_up(started, PLACEMENT_TIMEOUT_S))
            return False
        self.start(started)
        self.core.groups.replace(serving)
        self.tell(ranks)
        return True

    def tell(self, ranks: list[int]) -> None:
        """Tell those who listen that the engines of `ranks` are lost, once the group
        serves without them."""
        for listener in self.on_lost:
            listener(ranks)

    def start(self, groups: Sequence[WorkerGroup]) -> None:
        """Engines to take in once they are up (`ready_to_join`)."""
        self.joining.extend(groups)
        for group in groups:
            log.info("rollout rank(s) %s starting in the background on pool %s",
                     list(group.ranks), group.pool)  # fmt: skip
        self.count()

    def ready_to_join(self) -> WorkerGroup | None:
        """The engines started in the background that are up, as one group (None if
        none is). Starts engines on the pool's free GPUs first, if there are any, and
        again in the slots of those that could not start, once their wait is over."""
        try:
            more = self.core.groups.start_more(self.core.plan, Role.ROLLOUT, self.worker)
        except PlacementTimeout as error:  # Ray gave them to a lost engine's bundle first
            log.warning("%s: the free GPUs were taken meanwhile", error)
            more = None
        self.start([more] if more is not None else [])
        up = [group for group in self.joining if finished(group.ready)]
        self.joining = [group for group in self.joining if group not in up]
        started = [group for group in up if self.started(group)]
        now = time.monotonic()
        due = [retry for retry in self.retries if retry.due <= now]
        self.retries = [retry for retry in self.retries if retry.due > now]
        for retry in due:
            self.start(self.core.groups.respawn(Role.ROLLOUT, retry.slots, self.worker))
        self.count()
        return functools.reduce(WorkerGroup.joined, started) if started else None

    def started(self, group: WorkerGroup) -> bool:
        """Whether the engines of `group` (whose start has ended) are up. If not, they
        are shut down, and started again in their slots after a wait (`StartRetry`)."""
        try:
            join(group.ready)
        except Exception as error:  # its process died, or its engine could not be built
            failures = self.start_failures.get(group.slots, 0) + 1
            self.start_failures[group.slots] = failures
            delay = start_retry_delay(failures)
            group.shutdown(grace_s=0)
            self.retries.append(StartRetry(group.slots, time.monotonic() + delay))
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            log.warning("rollout rank(s) %s could not start on pool %s (%s); starting "
                        "again in their slots in %.0f s", list(group.ranks), group.pool,
                        reason, delay)  # fmt: skip
            return False
        self.start_failures.pop(group.slots, None)
        return True

    def join(self, joining: WorkerGroup) -> None:
        """Take the engines of `joining` in (between the trainer's calls to the engines)."""
        serving = self.group.joined(joining)
        with self.core.timeline.span(serving.pool, Role.ROLLOUT, ENGINES_JOINED):
            self.core.groups.replace(serving)
            self.core.weight_sync.reopen()
        log.info("rollout rank(s) %s joined: %d engine(s) serve",
                 list(joining.ranks), serving.world_size)  # fmt: skip
        self.count()

    def count(self) -> None:
        starting = sum(group.world_size for group in self.joining)
        self.metrics.observe_engines(
            self.group.pool, self.group.world_size, self.core.engines.replaced,
            joining=starting + sum(len(r.slots) for r in self.retries),
        )  # fmt: skip
