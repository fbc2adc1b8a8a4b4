"""The job's roles on Ray: placement groups per pool, a worker group per role.

The same code serves a KubeRay cluster (the operator's RayJob) and a laptop
(`cluster.local`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import PlacementPlan, in_actor_processes, roles_with_processes
from rlhf_trainer.cluster.groups import WorkerGroup, started_up
from rlhf_trainer.cluster.hangs import RankDied, RanksLost
from rlhf_trainer.cluster.placement import (
    PoolGroup,
    WorkerSlot,
    create_pool_groups,
    free_pool_gpus,
    place_more,
    remove_pool_groups,
    tp_slots,
    wait_ready,
)
from rlhf_trainer.cluster.rank_host import WorkerClass, WorkerPath
from rlhf_trainer.cluster.waits import finished, join

log = logging.getLogger(__name__)

# By name: the driver starts these without importing them (see WorkerPath).
WORKERS: dict[Role, WorkerPath] = {
    Role.ACTOR: WorkerPath("rlhf_trainer.roles.policy", "Actor"),
    Role.ROLLOUT: WorkerPath(
        "rlhf_trainer.rollout.worker", "RolloutWorker", needs_process_group=False
    ),
    Role.REF: WorkerPath("rlhf_trainer.roles.policy", "Ref"),
    Role.CRITIC: WorkerPath("rlhf_trainer.roles.critic", "Critic"),
    Role.REWARD: WorkerPath("rlhf_trainer.roles.reward", "RewardModel"),
}


@dataclass(frozen=True)
class WorkerSpec:
    """A role's worker class and its arguments after the rank's info (the job's config,
    and for fully async's StreamingRollout the queue): one value names a role's worker
    wherever its ranks start, at the run's start and when more start later."""

    cls: WorkerClass
    args: tuple[Any, ...] = ()


PLACEMENT_TIMEOUT_S = 600.0  # a pool's nodes may still be starting (autoscaling, pulls)
GROW_PLACEMENT_TIMEOUT_S = 30.0  # for GPUs seen free: they are there, or taken meanwhile


@dataclass
class RoleGroups:
    """One worker group per role that runs on a pool (a reward function runs on the
    driver and has none)."""

    groups: dict[Role, WorkerGroup]
    pools: dict[str, PoolGroup]
    # per role, how many ranks it has started: its next rank's number
    ranks_started: dict[Role, int] = field(default_factory=dict)
    # the ranks started since (`start_more`, `respawn`), taken in or not: all end with the run
    started_later: list[WorkerGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        for role, group in self.groups.items():  # a role's ranks are numbered from 0
            self.ranks_started.setdefault(role, max(group.ranks, default=-1) + 1)

    @classmethod
    def start(
        cls,
        plan: PlacementPlan,
        config: JobConfig,
        job: str,
        workers: Mapping[Role, WorkerSpec] | None = None,
        timeout_s: float = PLACEMENT_TIMEOUT_S,
    ) -> RoleGroups:
        """Place every pool, then start every role's ranks at once and wait for them
        (model loading and engine start-up overlap across roles).

        `workers` replaces a role's worker (fully async mode's streaming rollout)."""
        pools = wait_ready(create_pool_groups(plan, job), timeout_s)
        chosen = {role: WorkerSpec(cls, (config,)) for role, cls in WORKERS.items()}
        chosen |= workers or {}
        groups = {
            role: WorkerGroup.spawn(
                plan, role, pools[plan.roles[role].pool], chosen[role].cls, *chosen[role].args
            )
            for role in roles_with_processes(plan)
        }
        for role in in_actor_processes(plan):
            spec = chosen[role]
            groups[role] = WorkerGroup.beside(groups[Role.ACTOR], role, spec.cls, *spec.args)
        started = cls(groups, pools)
        try:
            join([ready for group in groups.values() for ready in group.ready])
            started.log_whereabouts()
        except BaseException:
            started.shutdown()
            raise
        return started

    def log_whereabouts(self) -> None:
        """One line per rank: which process on which node runs it (to find it with ps,
        py-spy or the node's logs)."""
        asked = {role: [h.whereabouts.remote() for h in g.hosts] for role, g in self.groups.items()}
        for role, futures in asked.items():
            group = self.groups[role]
            for rank, where in enumerate(join(futures)):
                pool, node = group.slots[rank].pool, f"{where.node_ip} ({where.node_id[:8]})"
                log.info(
                    "%s rank %d on pool %s: pid %d on node %s", role, rank, pool, where.pid, node
                )

    def __getitem__(self, role: Role) -> WorkerGroup:
        return self.groups[role]

    def replace(self, group: WorkerGroup) -> None:
        """`group` in place of its role's (the ranks that go on after some were lost,
        or with those that joined)."""
        self.groups[group.role] = group

    def start_more(self, plan: PlacementPlan, role: Role, worker: WorkerSpec) -> WorkerGroup | None:
        """Ranks of `role` on its pool's free GPUs (nodes that joined the pool since it
        was placed), one per tensor-parallel slice, numbered after every rank the role
        had; None when there are not enough. Placed now; their workers build in the
        background (`ready`)."""
        role_plan = plan.roles[role]
        pool = next(p for p in plan.pools if p.name == role_plan.pool)
        tp = role_plan.tensor_parallel_size
        count = free_pool_gpus(pool.name) // tp
        if count == 0:
            return None
        first = self.ranks_started.get(role, 0)
        placed = place_more(pool.name, count * tp, f"{pool.name}-from-{role}-{first}",
                            GROW_PLACEMENT_TIMEOUT_S)  # fmt: skip
        key = placed.group.id.hex()
        self.pools[key] = placed  # removed with the others at the end
        slots = tp_slots(pool, placed.rank_order, count, tp, placement=key)
        ranks = range(first, first + count)
        self.ranks_started[role] = first + count
        group = WorkerGroup.spawn_ranks(role, slots, ranks, placed, worker.cls, *worker.args)
        self.started_later.append(group)
        return group

    def respawn(
        self, role: Role, slots: Sequence[WorkerSlot], worker: WorkerSpec
    ) -> list[WorkerGroup]:
        """New ranks of `role` in the slots of ranks lost (their bundles stay reserved:
        Ray places them again on the node that replaces a lost one), numbered after
        every rank the role had; one group per placement group. Their workers build
        once the bundles are placed (`ready`); nothing here waits for it."""
        groups = []
        for key in dict.fromkeys(slot.group_key for slot in slots):
            mine = [slot for slot in slots if slot.group_key == key]
            first = self.ranks_started.get(role, 0)
            self.ranks_started[role] = first + len(mine)
            ranks = range(first, first + len(mine))
            pool_group = self.pools[key]
            groups.append(
                WorkerGroup.spawn_ranks(role, mine, ranks, pool_group, worker.cls, *worker.args)
            )
        self.started_later.extend(groups)
        return groups

    @staticmethod
    def started_up(groups: Sequence[WorkerGroup], timeout_s: float) -> WorkerGroup:
        """The ranks of `groups` (started in the background) as one group, once all are
        up; NoAnswer past `timeout_s`, or RanksLost naming those whose start failed."""
        try:
            return started_up(groups, timeout_s)
        except RankDied:
            failed = [rank for group in groups for rank, error in start_errors(group) if error]
            if not failed:
                raise
            raise RanksLost(groups[0].role, groups[0].pool, failed) from None

    @staticmethod
    def start_ended(group: WorkerGroup) -> bool:
        """Whether the start of every rank of `group` is over, well or not; never waits."""
        return finished(group.ready)

    @staticmethod
    def start_error(group: WorkerGroup) -> Exception | None:
        """What a rank of `group` raised as it started (call once its start ended)."""
        return next((error for _, error in start_errors(group) if error), None)

    def get(self, role: Role) -> WorkerGroup | None:
        return self.groups.get(role)

    def drain_calls(self) -> dict[Role, list[list[tuple[str, float, float]]]]:
        """Per role and rank, the calls run since the last drain. Every rank is asked at
        once: one round trip, not one per role, between a step's end and the next's."""
        asked = {role: group.drain_calls() for role, group in self.groups.items()}
        return {role: join(futures) for role, futures in asked.items()}

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        for group in self.started_later:  # those still starting (the others ended above)
            group.shutdown(grace_s=0)
        remove_pool_groups(self.pools)


def start_errors(group: WorkerGroup) -> list[tuple[int, Exception | None]]:
    """Each rank of `group` whose start ended, and what it raised (None: it is up)."""
    ended: list[tuple[int, Exception | None]] = []
    for rank, ready in zip(group.ranks, group.ready, strict=True):
        if finished([ready]):
            try:
                join([ready])
                ended.append((rank, None))
            except Exception as error:
                ended.append((rank, error))
    return ended
