"""The job's roles on Ray: placement groups per pool, a worker group per role.

The same code serves a KubeRay cluster (the operator's RayJob) and a laptop: there
`local_ray_cluster` starts a simulated Ray cluster with one node per pool replica,
each with the logical GPUs, the pool resource and the pool label the operator gives
the real nodes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.config import JobConfig, Role
from rlhf_trainer.placement import (
    POOL_LABEL,
    PoolGroup,
    create_pool_groups,
    pool_resource,
    remove_pool_groups,
    wait_ready,
)
from rlhf_trainer.plan import DRIVER, PlacementPlan
from rlhf_trainer.roles import Actor, Critic, Ref, RewardModel, RolloutWorker
from rlhf_trainer.workers import Worker, WorkerGroup, join

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
        except BaseException:
            started.shutdown()
            raise
        return started

    def __getitem__(self, role: Role) -> WorkerGroup:
        return self.groups[role]

    def get(self, role: Role) -> WorkerGroup | None:
        return self.groups.get(role)

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        remove_pool_groups(self.pools)


@contextmanager
def local_ray_cluster(config: JobConfig) -> Iterator[str]:
    """A simulated Ray cluster on this machine shaped like the job's pools; yields its
    address after connecting to it."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for pool in config.pools:
            for _ in range(pool.replicas):
                cluster.add_node(
                    num_cpus=1,
                    num_gpus=pool.gpus_per_node,
                    resources={pool_resource(pool.name): pool.gpus_per_node},
                    labels={POOL_LABEL: pool.name},
                )
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield str(cluster.address)
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
