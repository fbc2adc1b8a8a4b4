"""Synchronous modes' rollout engines that are lost, replaced in their bundles.

A rollout rank whose vLLM engine dies ends its process (`rollout.worker.end_rank`), so
every way an engine goes (its vLLM engine, its process, its node) reaches the driver as
a rank lost. The trainer then replaces it, between its calls to the engines: a new
rank in the lost one's bundle (Ray places it again, on the node that replaces a lost
one), built from the model directory, taken into the weight transfer, and given the
current weights by a push before it generates. Nothing of the dead engine is needed, so
an engine recovers the same way on every weight transfer, GPUs included. An engine that the
loss left stuck in the failed push (an NCCL receive, which nothing ends from outside)
is replaced too, not counted against the limit below. Fully async
does the same through its elastic membership (`elastic_rollout`).

A replacement takes its predecessor's place in the group, and so its part of the
batch and its seeds: the step's samples are the ones the lost engine would have made.
`generation.maxEngineRestarts` bounds how many times the engine in any one bundle is
replaced in a run, in both modes: an engine that dies again and again (a node whose GPU
fails, a prompt that crashes vLLM) fails the run, naming it, while a pool that loses
many nodes once each (scaled down, spot nodes) goes on.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.cluster.groups import started_up
from rlhf_trainer.cluster.hangs import RankDied, RanksLost
from rlhf_trainer.cluster.placement import WorkerSlot
from rlhf_trainer.cluster.role_groups import PLACEMENT_TIMEOUT_S, RoleGroups, WorkerSpec
from rlhf_trainer.loop.weights import EnginesStuck, WeightSync

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineRestartsExhausted(RuntimeError):
    """A rollout bundle lost its engine once more than `generation.maxEngineRestarts`."""


def check_replacements(lost: RanksLost, times_replaced: Sequence[int], limit: int) -> None:
    """Raise EngineRestartsExhausted, naming them, if any engine of `lost` is in a bundle
    whose engine was replaced `limit` times already (`times_replaced`: for each of
    lost.ranks, in order)."""
    over = [(rank, times) for rank, times in zip(lost.ranks, times_replaced, strict=True)
            if times >= limit]  # fmt: skip
    if over:
        bundles = ", ".join(f"rollout rank {rank}'s {times} time(s)" for rank, times in over)
        raise EngineRestartsExhausted(
            f"{lost}: generation.maxEngineRestarts is {limit}, and the engine in its bundle "
            f"was replaced already ({bundles})"
        )


class EngineReplacement:
    """Replaces the rollout engines that a synchronous run loses, and counts them in
    both modes (fully async replaces its own: `elastic_rollout`)."""

    def __init__(
        self,
        config: JobConfig,
        groups: RoleGroups,
        weight_sync: WeightSync,
        worker: WorkerSpec,
    ) -> None:
        self.config = config
        self.groups = groups
        self.weight_sync = weight_sync
        self.worker = worker  # the engines' (a toy engine's in tests)
        self.replaced = 0  # engines, in this run
        self.by_bundle: Counter[WorkerSlot] = Counter()  # the replacements in each bundle

    def count(self, lost: RanksLost) -> None:
        """Count the engines of `lost` (rollout ranks of the group that serves) as
        replaced; past generation.maxEngineRestarts in any one bundle,
        EngineRestartsExhausted naming them (and nothing counted). Engines stuck in a
        push that another's loss failed (EnginesStuck) are not counted against it."""
        slots = self.groups[Role.ROLLOUT].slots_of(lost.ranks)
        if not isinstance(lost, EnginesStuck):
            times = [self.by_bundle[slot] for slot in slots]
            check_replacements(lost, times, self.config.generation.max_engine_restarts)
            self.by_bundle.update(slots)
        self.replaced += len(slots)

    def surviving(
        self,
        call: Callable[[], T],
        reload: Callable[[], int] | None = None,
        lost_in: type[BaseException] = RankDied,
    ) -> T:
        """`call` (to the rollout engines), made again after replacing any that were
        lost in it (or in the push before it); `reload`: the policy version to push to
        the engines before `call` again (the actor's current weights), when `call`
        does not bring them itself. `lost_in`: the errors that may mean an engine was
        lost (a push fails with the transfer's own error, or a peer's): the engines
        are then asked, and with none dead the error is the call's own."""
        replaced = False
        while True:
            try:
                if replaced and reload is not None:
                    self.weight_sync.push(reload())
                return call()
            except lost_in:
                rollout = self.groups[Role.ROLLOUT]
                dead = rollout.dead_ranks()
                if not dead:
                    raise  # not an engine lost: another role's rank, or the call's own
            self.replace(RanksLost(Role.ROLLOUT, rollout.pool, dead))
            replaced = True

    def replace(self, lost: RanksLost) -> None:
        """New engines in the bundles of those of `lost`, up and in the weight transfer;
        those that the loss left stuck in the transfer (EnginesStuck: NCCL) are
        replaced too, once."""
        self.respawn(lost)
        try:
            self.weight_sync.reopen()
        except EnginesStuck as stuck:
            log.warning("%s: they are replaced too", stuck)
            self.respawn(stuck)
            self.weight_sync.reopen()

    def respawn(self, lost: RanksLost) -> None:
        """New engines in the bundles of those of `lost`, up, serving in their place."""
        self.count(lost)
        before = self.groups[Role.ROLLOUT]
        gone = before.without(before.without(lost.ranks).ranks)
        gone.shutdown(grace_s=0)  # a stopped one must not come back
        log.warning("%s: starting new engines in their bundles (%d replaced in this run)",
                    lost, self.replaced)  # fmt: skip
        started = self.groups.respawn(Role.ROLLOUT, gone.slots, self.worker)
        new = started_up(started, PLACEMENT_TIMEOUT_S)
        serving = before.substituted(new)
        self.groups.replace(serving)
        log.info("rollout rank(s) %s serve in place of %s", list(new.ranks), list(lost.ranks))
