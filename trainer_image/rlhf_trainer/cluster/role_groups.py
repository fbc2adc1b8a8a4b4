"""The job's roles on Ray: placement groups per pool, a worker group per role.

The same code serves a KubeRay cluster (the operator's RayJob) and a laptop
(`cluster.local`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import DRIVER, PlacementPlan
from rlhf_trainer.cluster.groups import WorkerGroup, join
from rlhf_trainer.cluster.placement import (
    PoolGroup,
    create_pool_groups,
    remove_pool_groups,
    wait_ready,
)
from rlhf_trainer.roles.critic import Critic
from rlhf_trainer.roles.policy import Actor, Ref
from rlhf_trainer.roles.reward import RewardModel
from rlhf_trainer.rollout.worker import RolloutWorker
from rlhf_trainer.worker import Worker

log = logging.getLogger(__name__)

WORKERS: dict[Role, type[Worker]] = {
    Role.ACTOR: Actor,
    Role.ROLLOUT: RolloutWorker,
    Role.REF: Ref,
    Role.CRITIC: Critic,
    Role.REWARD: RewardModel,
}

PLACEMENT_TIMEOUT_S = 600.0  # a pool's nodes may still be starting (autoscaling, pulls)


@dataclass
class RoleGroups:
    """One worker group per role that runs on a pool (a reward function runs on the
    driver and has none)."""

    groups: dict[Role, WorkerGroup]
    pools: dict[str, PoolGroup]

    @classmethod
    def start(
        cls,
        plan: PlacementPlan,
        config: JobConfig,
        job: str,
        workers: Mapping[Role, tuple[type[Worker], tuple[Any, ...]]] | None = None,
        timeout_s: float = PLACEMENT_TIMEOUT_S,
    ) -> RoleGroups:
        """Place every pool, then start every role's ranks at once and wait for them
        (model loading and engine start-up overlap across roles).

        `workers` replaces a role's worker class, with extra constructor arguments after
        the config (fully async mode's streaming rollout takes the queue)."""
        pools = wait_ready(create_pool_groups(plan, job), timeout_s)
        chosen = {role: (cls, ()) for role, cls in WORKERS.items()} | dict(workers or {})
        groups = {
            role: WorkerGroup.spawn(
                plan, role, pools[role_plan.pool], chosen[role][0], config, *chosen[role][1]
            )
            for role, role_plan in plan.roles.items()
            if role_plan.pool != DRIVER
        }
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
        """`group` in place of its role's (the ranks that go on after some were lost)."""
        self.groups[group.role] = group

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
        remove_pool_groups(self.pools)
