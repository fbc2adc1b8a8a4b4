"""Placement on Ray: one placement group per pool, one bundle per GPU.

The operator gives every Ray worker node of a pool a logical resource named after the
pool (`pool_resource`), as many units as the node has GPUs. A bundle asks for one GPU
and one unit of that resource, so Ray can put it only on a node of its pool: that is
what pins a pool's workers to the pool's node group. PACK fills a node before using
the next, so a pool of 2 nodes x 4 GPUs gets 4 bundles on each node.

Colocated roles share the bundles: rank r of every role on a pool sits in bundle r
and takes a fraction of its GPU (`gpu_share`). Ray then hands all of them the same
device, and the step schedule (plan.py) runs them one after another, never at the
same time.

A rollout engine with tensor parallelism t owns t bundles of one node (`WorkerSlot.
engine_bundles`). Its rank's process sits in the first and asks for no GPU; vLLM's Ray
executor puts one worker in each of the engine's bundles, at the pool's share
(`engine_environment`: vLLM's `VLLM_RAY_BUNDLE_INDICES` and `VLLM_RAY_PER_WORKER_GPUS`).
So every bundle holds one share per role, whatever t is, and a worker's GPU is the GPU
of the actor rank in the same bundle (which CUDA IPC needs). Without the indices vLLM
would take the first t GPU bundles of the whole pool at a whole GPU each; and a rank
process holding one GPU share would see one device, and vLLM's config refuses a world
larger than that before it looks at Ray.

The pure part (names, bundles, shares, rank order) needs no Ray; the functions that
talk to Ray import it when called, because the operator imports `pool_resource` and
runs without Ray installed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.names import POOL_LABEL, pool_resource
from rlhf_trainer.api.plan import DRIVER, PlacementPlan, PoolPlan
from rlhf_trainer.rollout.engine_settings import RAY_BUNDLES_VARIABLE, RAY_WORKER_GPUS_VARIABLE

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

Bundle = dict[str, float]


# Each pool's placement group packs its bundles onto as few of the pool's nodes as
# possible; STRICT_PACK would forbid a pool of several nodes.
POOL_STRATEGY = "PACK"


def placement_group_name(job: str, pool: str) -> str:
    # Named, so `ray list placement-groups` shows which pool a group belongs to.
    return f"{job}-{pool}"


def gpu_bundle(pool: str) -> Bundle:
    """One GPU of the pool. No CPU: the workers ask for none (`WorkerGroup.spawn`), and a
    node's CPUs are not what limits how many workers fit on it, its GPUs are."""
    return {"GPU": 1, pool_resource(pool): 1}


def pool_bundles(pool: PoolPlan) -> list[Bundle]:
    return [gpu_bundle(pool.name) for _ in range(pool.total_gpus)]


def gpu_share(pool: PoolPlan) -> float:
    """The fraction of a GPU each colocated role's worker asks for within its bundle.

    Equal shares that add up to at most one GPU, so all the pool's roles fit on every
    bundle at once (their models stay resident, as colocated PPO needs), and Ray gives
    them the same device. The share is a scheduling fraction, not a memory limit.
    """
    return 1.0 / len(pool.roles)


@dataclass(frozen=True)
class WorkerSlot:
    """Where one data-parallel rank of a role runs: a bundle of its pool's group, or of
    the group `placement` names (the key of GPUs placed later: `RoleGroups.start_more`)."""

    pool: str
    bundle_index: int
    gpu_share: float
    placement: str = ""  # "": the pool's own group
    # A tensor-parallel engine's bundles, one per vLLM worker, the first being
    # `bundle_index`; () for a rank that computes in its own process.
    engine_bundles: tuple[int, ...] = ()

    @property
    def group_key(self) -> str:
        """Its placement group's key in `RoleGroups.pools`."""
        return self.placement or self.pool

    @property
    def process_gpus(self) -> float:
        """What the rank's own process asks Ray for: its share of the bundle's GPU, or
        nothing for a tensor-parallel engine, whose vLLM workers take the share in each
        of its bundles. (A process that asks for no GPU sees all of its node's: Ray
        2.60 leaves CUDA_VISIBLE_DEVICES alone then.)"""
        return 0.0 if self.engine_bundles else self.gpu_share


def role_slots(plan: PlacementPlan, role: Role, bundle_order: Sequence[int]) -> list[WorkerSlot]:
    """The slot of each rank of `role`, rank 0 first.

    `bundle_order` lists the pool's bundle indices in rank order (`rank_order`), so the
    ranks on one node are consecutive (`tp_slots`).
    """
    role_plan = plan.roles[role]
    if role_plan.pool == DRIVER:
        raise ValueError(f"role {role} runs on the driver, not on a pool: it has no slots")
    pool = next(p for p in plan.pools if p.name == role_plan.pool)
    if len(bundle_order) != pool.total_gpus:
        raise ValueError(
            f"pool {pool.name} has {pool.total_gpus} bundles, got an order of {len(bundle_order)}"
        )
    return tp_slots(
        pool, bundle_order, role_plan.data_parallel_size, role_plan.tensor_parallel_size
    )


def tp_slots(
    pool: PoolPlan, bundle_order: Sequence[int], count: int, tp: int, placement: str = ""
) -> list[WorkerSlot]:
    """The slots of `count` ranks of t = `tp` GPUs each, in `bundle_order`: rank r owns
    bundles `bundle_order[r*t : (r+1)*t]`, of one node (t divides a node's GPUs, and the
    order groups a node's bundles), and is placed in the first."""
    share = gpu_share(pool)
    slots = []
    for rank in range(count):
        bundles = tuple(bundle_order[rank * tp : (rank + 1) * tp])
        slots.append(WorkerSlot(pool.name, bundles[0], share, placement, bundles if tp > 1 else ()))
    return slots


def engine_environment(slot: WorkerSlot) -> dict[str, str]:
    """The environment in which a rank's vLLM engine places its tensor-parallel
    workers on the slot's own bundles, at the pool's GPU share each (read by vLLM's Ray
    executor, in the engine's process); {} for a slot of one GPU."""
    if not slot.engine_bundles:
        return {}
    return {
        RAY_BUNDLES_VARIABLE: ",".join(map(str, slot.engine_bundles)),
        RAY_WORKER_GPUS_VARIABLE: repr(slot.gpu_share),
    }


def rank_order(bundle_nodes: Sequence[str]) -> list[int]:
    """Bundle indices grouped by node (nodes in order of first appearance), so ranks on
    one node are consecutive: NCCL and FSDP assume it, and PACK does not promise it."""
    first_seen = {node: i for i, node in reversed(list(enumerate(bundle_nodes)))}
    return sorted(range(len(bundle_nodes)), key=lambda i: (first_seen[bundle_nodes[i]], i))


class PlacementTimeout(TimeoutError):
    """A pool's placement group did not become ready: the cluster lacks what it asks for."""


@dataclass(frozen=True)
class PoolGroup:
    """A pool's placement group once ready, with where each of its bundles landed."""

    pool: str
    group: PlacementGroup
    bundle_nodes: tuple[str, ...]  # Ray node id of each bundle, by bundle index

    @property
    def rank_order(self) -> list[int]:
        return rank_order(self.bundle_nodes)

    def scheduling(self, slot: WorkerSlot) -> PlacementGroupSchedulingStrategy:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=slot.bundle_index,
            # Whatever the worker starts (tasks, vLLM's own actors) stays on the pool.
            placement_group_capture_child_tasks=True,
        )


def create_pool_groups(plan: PlacementPlan, job: str) -> dict[str, PlacementGroup]:
    """Ask Ray for every pool's group. Returns at once; `wait_ready` waits for them."""
    return {
        pool.name: pool_placement_group(
            pool.name, pool_bundles(pool), placement_group_name(job, pool.name)
        )
        for pool in plan.pools
    }


def pool_placement_group(pool: str, bundles: list[Bundle], name: str) -> PlacementGroup:
    """Ask Ray for the pool's `bundles`, packed; returns at once."""
    from ray.util.placement_group import placement_group

    group: PlacementGroup = placement_group(
        bundles,
        strategy=POOL_STRATEGY,
        name=name,
        # The pool resource already pins the bundles; the label says the same in the
        # words of `ray list nodes`, and guards a node given the wrong resource.
        bundle_label_selector=[{POOL_LABEL: pool}] * len(bundles),
    )
    return group


def wait_ready(groups: Mapping[str, PlacementGroup], timeout_s: float) -> dict[str, PoolGroup]:
    """Wait until every pool's group is placed, or raise `PlacementTimeout` naming the
    first pool that is not, what it asked for and what the cluster has of it."""
    import ray
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + timeout_s
    for pool, group in groups.items():
        ready, _ = ray.wait([group.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            total = ray.cluster_resources()  # type: ignore[no-untyped-call]
            free = ray.available_resources()  # type: ignore[no-untyped-call]
            raise PlacementTimeout(
                _not_ready_message(pool, group.bundle_specs, timeout_s, total, free)
            )
    placed = {}
    for pool, group in groups.items():
        by_index = placement_group_table(group)["bundles_to_node_id"]
        nodes = tuple(by_index[i] for i in range(len(group.bundle_specs)))
        placed[pool] = PoolGroup(pool, group, nodes)
    return placed


def _not_ready_message(
    pool: str,
    bundles: Sequence[Mapping[str, float]],
    timeout_s: float,
    total: Mapping[str, float],
    free: Mapping[str, float],
) -> str:
    wanted: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            wanted[name] = wanted.get(name, 0) + amount

    def amounts(of: Mapping[str, float]) -> str:
        return ", ".join(f"{name}={of.get(name, 0):g}" for name in sorted(wanted))

    first = dict(bundles[0]) if bundles else {}
    return (
        f"pool {pool!r}: placement group not ready after {timeout_s:g} s. It asks for "
        f"{len(bundles)} bundle(s) of {first} ({amounts(wanted)}); the cluster has "
        f"{amounts(total)} in all, {amounts(free)} free. Are all the pool's Ray nodes up, "
        f"each with its GPUs, the resource {pool_resource(pool)!r} and the label "
        f"{POOL_LABEL}={pool}?"
    )


def free_pool_gpus(pool: str) -> int:
    """GPUs of the pool's nodes that no placement group holds: nodes that joined the
    pool after it was placed (a bigger `replicas`)."""
    import ray

    return int(ray.available_resources().get(pool_resource(pool), 0))  # type: ignore[no-untyped-call]


def place_more(pool: str, gpus: int, name: str, timeout_s: float) -> PoolGroup:
    """A placement group of `gpus` more bundles on the pool's free GPUs, once ready;
    raises PlacementTimeout (naming the pool) if they went meanwhile."""
    group = pool_placement_group(pool, [gpu_bundle(pool)] * gpus, name)
    try:
        return wait_ready({pool: group}, timeout_s)[pool]
    except PlacementTimeout:
        remove_pool_groups({pool: group})
        raise


def remove_pool_groups(groups: Mapping[str, PlacementGroup | PoolGroup]) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in groups.values():
        remove_placement_group(group.group if isinstance(group, PoolGroup) else group)
