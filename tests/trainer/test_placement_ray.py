"""Placement groups and worker groups on a real Ray cluster.

One simulated cluster for the module (starting it takes 8-20 s here): a CPU head and
one node per pool replica, with logical GPUs, the custom resource and the node label
taken from the RayJob the operator renders, so the trainer is tested against what the
operator really gives it. Pool "policy" (actor, rollout, ref) has 2 GPUs on one node,
pool "value" (critic) 1 GPU on another. One more node is mis-labelled on purpose: it
carries pool "stray"'s resource but another pool's label. (Weight pushes that lose an
engine: test_weight_push_faults.py.)
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray import cluster_utils

from rlhf_env.rewards import reward_app_for
from rlhf_operator.api.validation import parse_job
from rlhf_operator.render.children import JobRef, render_rayjob
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.names import POOL_LABEL, pool_resource
from rlhf_trainer.api.plan import PlacementPlan, plan_placement
from rlhf_trainer.cluster.engine_stats import EngineStatsPoller
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import RankDied
from rlhf_trainer.cluster.placement import (
    PlacementTimeout,
    PoolGroup,
    create_pool_groups,
    remove_pool_groups,
    wait_ready,
)
from rlhf_trainer.cluster.role_groups import RoleGroups, WorkerSpec
from rlhf_trainer.cluster.waits import gather, join, results_as_they_come
from rlhf_trainer.data.prompts import Prompt, PromptStream
from rlhf_trainer.loop.membership import EngineMembership, Replacement
from rlhf_trainer.loop.rewards import Scorer, Tokens
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import PPOTrainer
from rlhf_trainer.loop.weights import WeightSync
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.timeline import Timeline
from tests.environments import served
from tests.trainer.toy_workers import (
    BusyEngine,
    HeldRollout,
    PartialSums,
    wait_until_dead,
)
from tests.unit.conftest import EXAMPLES, load

READY_TIMEOUT_S = 120  # generous: other test runs share this machine's two cores


def job_manifest() -> dict[str, Any]:
    manifest = copy.deepcopy(load(EXAMPLES[0].parent / "local-cpu.yaml"))
    manifest["spec"]["pools"][0]["gpusPerNode"] = 2
    return manifest


@dataclass(frozen=True)
class RayPools:
    plan: PlacementPlan
    pool_nodes: dict[str, set[str]]  # pool -> Ray node ids, found by the node label
    groups: dict[str, PoolGroup]


@pytest.fixture(scope="module")
def ray_pools() -> Iterator[RayPools]:
    job = parse_job(job_manifest())
    rayjob = render_rayjob(JobRef(job.metadata.name, "default", "uid"), job.spec)
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0}
    )
    try:
        for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
            resources = {k: float(v) for k, v in group["resources"].items()}
            gpus = resources.pop("GPU")
            for _ in range(group["replicas"]):
                cluster.add_node(
                    num_cpus=1, num_gpus=gpus, resources=resources, labels=group["labels"]
                )
        cluster.add_node(
            num_cpus=0,
            num_gpus=1,
            resources={pool_resource("stray"): 1},
            labels={POOL_LABEL: "not-stray"},
        )
        ray.init(address=cluster.address, include_dashboard=False)
        pool_nodes: dict[str, set[str]] = {}
        for node in ray.nodes():
            if POOL_LABEL in node.get("Labels", {}):
                pool_nodes.setdefault(node["Labels"][POOL_LABEL], set()).add(node["NodeID"])
        plan = plan_placement(job.spec)
        groups = wait_ready(create_pool_groups(plan, job.metadata.name), READY_TIMEOUT_S)
        yield RayPools(plan, pool_nodes, groups)
        remove_pool_groups(groups)
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def groups(ray_pools: RayPools) -> Iterator[dict[Role, WorkerGroup]]:
    spawned = {
        role: WorkerGroup.spawn(
            ray_pools.plan, role, ray_pools.groups[ray_pools.plan.roles[role].pool], PartialSums
        )
        for role in (Role.ACTOR, Role.ROLLOUT, Role.CRITIC)  # toy workers in their places
    }
    ray.get([ref for group in spawned.values() for ref in group.ready])  # built together
    yield spawned
    for group in spawned.values():
        group.shutdown()


def test_the_cluster_is_what_the_operator_renders(ray_pools: RayPools) -> None:
    assert {pool: len(nodes) for pool, nodes in ray_pools.pool_nodes.items()} == {
        "policy": 1,
        "value": 1,
        "not-stray": 1,
    }


def test_each_pool_group_lands_on_its_pools_nodes(ray_pools: RayPools) -> None:
    for pool, group in ray_pools.groups.items():
        assert set(group.bundle_nodes) <= ray_pools.pool_nodes[pool]
    assert len(ray_pools.groups["policy"].bundle_nodes) == 2


def test_every_worker_runs_on_a_node_of_its_pool(
    ray_pools: RayPools, groups: dict[Role, WorkerGroup]
) -> None:
    for role, group in groups.items():
        pool = ray_pools.plan.roles[role].pool
        assert group.world_size == ray_pools.plan.roles[role].data_parallel_size
        assert {w.node_id for w in group.whereabouts()} <= ray_pools.pool_nodes[pool], role


def test_colocated_roles_share_their_gpus(groups: dict[Role, WorkerGroup]) -> None:
    actor, rollout = groups[Role.ACTOR].whereabouts(), groups[Role.ROLLOUT].whereabouts()
    assert [w.gpu_ids for w in actor] == [w.gpu_ids for w in rollout]
    assert len({w.gpu_ids for w in actor}) == 2  # one GPU per rank, each its own
    assert all(len(w.gpu_ids) == 1 for w in actor)


def test_data_parallel_all_reduce_over_an_uneven_batch(groups: dict[Role, WorkerGroup]) -> None:
    batch = torch.arange(7.0)  # 4 rows on rank 0, 3 on rank 1
    refs = groups[Role.ACTOR].run_sharded("total_sum", batch)
    assert ray.get(refs) == [21.0, 21.0]
    assert ray.get(groups[Role.ACTOR].run("total_sum", torch.ones(3))) == [6.0, 6.0]


def test_gather_rejoins_in_rank_order(groups: dict[Role, WorkerGroup]) -> None:
    x = torch.arange(5.0)
    out = gather(groups[Role.ROLLOUT].run_sharded("doubled", x))
    assert torch.equal(out[:, 0], x * 2)
    assert out[:, 1].tolist() == [0, 0, 0, 1, 1]


def test_groups_on_different_pools_run_at_the_same_time(groups: dict[Role, WorkerGroup]) -> None:
    # Issued together, joined after: the intervals overlap (no wall-time assertion).
    actor = groups[Role.ACTOR].run("sleep", 1.0)
    critic = groups[Role.CRITIC].run("sleep", 1.0)
    intervals = ray.get(actor + critic)
    assert max(start for start, _ in intervals) < min(end for _, end in intervals)


def test_a_role_beside_the_actor_lives_in_its_processes_and_shares_its_process_group(
    groups: dict[Role, WorkerGroup],
) -> None:
    """`WorkerGroup.beside` (a critic on the actor's pool, plan.in_actor_processes): its
    ranks are built in the actor's processes, its calls reach its own worker, its
    collectives run over the actor's process group (the constructor all-reduces), the
    timeline gets its calls under its role, and ending it leaves the actor's ranks up."""
    actor = groups[Role.ACTOR]
    beside = WorkerGroup.beside(actor, Role.CRITIC, PartialSums)
    try:
        join(beside.ready, READY_TIMEOUT_S)
        assert [w.pid for w in beside.whereabouts()] == [w.pid for w in actor.whereabouts()]
        assert join(beside.run("whose")) == [(Role.CRITIC, 0), (Role.CRITIC, 1)]
        assert join(actor.run("whose")) == [(Role.ACTOR, 0), (Role.ACTOR, 1)]
        assert join(beside.run_sharded("total_sum", torch.arange(7.0))) == [21.0, 21.0]
        drained = join(beside.drain_calls())
        assert [[phase for phase, _, _ in calls] for calls in drained] == [
            ["whose", "total_sum"]
        ] * 2
    finally:
        beside.shutdown()
    assert join(actor.run("whose")) == [(Role.ACTOR, 0), (Role.ACTOR, 1)]


def test_a_call_after_another_roles_starts_once_it_ends_and_fails_with_it(
    groups: dict[Role, WorkerGroup],
) -> None:
    actor, rollout = groups[Role.ACTOR], groups[Role.ROLLOUT]  # colocated: they take turns
    first = actor.run("sleep", 0.5)
    second = rollout.run("sleep", 0.0, after=first)  # sent at once, started after
    for (_, first_end), (second_start, _) in zip(join(first), join(second), strict=True):
        assert second_start >= first_end
    failed = actor.run("fail", "the actor ran out of memory")
    with pytest.raises(ray.exceptions.RayTaskError, match="the actor ran out of memory"):
        join(rollout.run("sleep", 0.0, after=failed))


def test_a_pool_the_cluster_cannot_hold_times_out_naming_it(ray_pools: RayPools) -> None:
    manifest = job_manifest()
    manifest["spec"]["pools"][1]["gpusPerNode"] = 4  # the value node has 1 GPU
    plan = plan_placement(parse_job(manifest).spec)
    pending = create_pool_groups(plan, "too-big")
    try:
        with pytest.raises(PlacementTimeout, match=r"pool 'value': .* 4 bundle\(s\)"):
            wait_ready({"value": pending["value"]}, timeout_s=1)
    finally:
        remove_pool_groups(pending)


def test_a_node_with_the_pools_resource_but_another_label_is_not_used(
    ray_pools: RayPools,
) -> None:
    manifest = job_manifest()
    manifest["spec"]["pools"] = [{"name": "stray", "gpusPerNode": 1}]
    manifest["spec"]["roles"] = {role: "stray" for role in ("actor", "rollout", "ref", "critic")}
    plan = plan_placement(parse_job(manifest).spec)
    pending = create_pool_groups(plan, "stray")
    try:
        # The resource and a GPU are free on the mis-labelled node, yet nothing lands.
        assert ray.available_resources()[pool_resource("stray")] == 1
        with pytest.raises(PlacementTimeout, match=r"label rlhf\.dev/pool=stray\?"):
            wait_ready(pending, timeout_s=1)
    finally:
        remove_pool_groups(pending)


@pytest.mark.parametrize("peer_fails_first", [False, True], ids=["dies", "peer-fails-first"])
def test_a_rank_dying_mid_collective_fails_the_call_instead_of_hanging(
    ray_pools: RayPools, peer_fails_first: bool, tmp_path: Path
) -> None:
    """Rank 0 is stuck in all_reduce (until the 10-minute rendezvous timeout) when rank 1
    dies; `join` must raise the death at once, naming the rank, and shutdown must still
    end the group. Also when rank 0's call fails first, with gloo's "connection closed"
    (seen on a loaded machine): the death is still what is named."""
    group = WorkerGroup.spawn(ray_pools.plan, Role.ACTOR, ray_pools.groups["policy"], PartialSums)
    join(group.ready)
    seen_first = str(tmp_path / "peer-failed") if peer_fails_first else ""
    try:
        died = r"^actor rank 1 on pool policy \(die_in_all_reduce\) died: its process ended"
        with pytest.raises(RankDied, match=died):
            join(group.run("die_in_all_reduce", 1, seen_first))
    finally:
        group.shutdown(grace_s=1)
    for host in group.hosts:  # both ended: the stuck rank 0 too
        wait_until_dead(host)


def test_engines_report_their_stats_and_calls_while_busy_and_a_dead_one_loses_its_series(
    ray_pools: RayPools,
) -> None:
    """The rollout ranks answer on their telemetry thread while their working thread
    sleeps in a call: each engine's stats, with its pool and rank on the series, and the
    calls it finished for the timeline (the one in progress comes with a later drain)."""
    group = WorkerGroup.spawn(ray_pools.plan, Role.ROLLOUT, ray_pools.groups["policy"], BusyEngine)
    join(group.ready)
    metrics = TrainerMetrics()
    poller = EngineStatsPoller(group, metrics.engines.observe)

    def generated(engine: str) -> float | None:
        labels = {"pool": "policy", "engine": engine}
        return metrics.registry.get_sample_value("rlhf_vllm_generation_tokens_total", labels)

    try:
        join(group.run("sleep", 0.0, phase="short"))
        busy = group.run("sleep", 120.0, phase="long")
        poller.poll(timeout_s=60)
        drained = join(group.drain_calls(), timeout_s=60)
        assert ray.wait(busy, timeout=0)[0] == [], "the ranks answered after their call"
        assert (group.world_size, generated("0"), generated("1")) == (2, 100, 101)
        assert [[phase for phase, _, _ in calls] for calls in drained] == [["short"], ["short"]]
        ray.kill(group.hosts[1])
        wait_until_dead(group.hosts[1])
        poller.poll(timeout_s=60)
        assert (generated("0"), generated("1")) == (100, None)
    finally:
        group.shutdown(grace_s=1)


@pytest.mark.parametrize("dying_rank", [None, 1])
def test_a_streaming_call_hands_each_result_over_as_it_comes_and_names_a_rank_that_dies(
    ray_pools: RayPools, tmp_path: Path, dying_rank: int | None
) -> None:
    """`stream_each` and `results_as_they_come` (how a synchronous step takes each
    sample as it finishes): each rank's first result comes while every rank still waits
    for the test's go-ahead, so before any call could have returned; the rest follow,
    each with its rank's place. A rank that dies after its first result is named."""
    group = WorkerGroup.spawn(ray_pools.plan, Role.ROLLOUT, ray_pools.groups["policy"], BusyEngine)
    join(group.ready)
    go_ahead = tmp_path / "go-ahead"
    shards = [[10 * rank, 10 * rank + 1, 10 * rank + 2] for rank in range(group.world_size)]
    try:
        streams = group.stream_each(
            "count_up", shards, str(go_ahead), -1 if dying_rank is None else dying_rank
        )
        results = results_as_they_come(streams)
        # Each rank's first result, while every rank waits for the go-ahead: a reader
        # that waited for whole calls would get none (count_up then fails, named).
        firsts = {next(results) for _ in range(group.world_size)}
        assert firsts == {(place, (shard[0], place)) for place, shard in enumerate(shards)}
        go_ahead.touch()
        if dying_rank is not None:
            died = (
                rf"^rollout rank {dying_rank} on pool policy \(count_up\) died: its process ended"
            )
            with pytest.raises(RankDied, match=died):
                list(results)
            return
        rest = list(results)
    finally:
        group.shutdown(grace_s=1)
    expected = [
        (place, (value, place)) for place, shard in enumerate(shards) for value in shard[1:]
    ]
    assert sorted(rest) == expected
    for place, _ in enumerate(shards):  # each rank's results in the order it yielded them
        assert [value for at, (value, _) in rest if at == place] == shards[place][1:]


def test_a_rank_is_lost_once_ray_finds_it_dead_or_it_stays_silent_not_while_it_is_slow(
    ray_pools: RayPools, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 stops (SIGSTOP) for longer than a ping's probe (PROBE_S) but less than
    LOST_AFTER_S, as a rank starved of CPU on a loaded node may: it is not lost. Stopped
    for good, it is lost once LOST_AFTER_S has passed; killed, at once. (Both times are
    shortened here.)"""
    from rlhf_trainer.cluster import groups as worker_groups
    from rlhf_trainer.cluster import hangs

    monkeypatch.setattr(hangs, "PROBE_S", 1.0)
    monkeypatch.setattr(worker_groups, "LOST_AFTER_S", 8.0)
    group = WorkerGroup.spawn(ray_pools.plan, Role.ROLLOUT, ray_pools.groups["policy"], BusyEngine)
    join(group.ready)
    pid = group.whereabouts()[1].pid
    try:
        os.kill(pid, signal.SIGSTOP)
        # Taken before the timer starts: taken after it, the wake-up came 2.997 s later
        # in a full run (the 3 s count from the timer's start).
        started = time.monotonic()
        threading.Timer(3.0, os.kill, (pid, signal.SIGCONT)).start()
        assert group.dead_ranks() == []  # it answered within LOST_AFTER_S
        assert time.monotonic() - started >= 3.0  # after it was woken: it was waited for
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        assert group.dead_ranks() == [1]
        assert time.monotonic() - started >= 8.0  # not before LOST_AFTER_S
        os.kill(pid, signal.SIGKILL)
        wait_until_dead(group.hosts[1])
        # Silence alone could not make it lost now: only Ray's verdict that it died.
        monkeypatch.setattr(worker_groups, "LOST_AFTER_S", 600.0)
        assert group.dead_ranks() == [1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        group.shutdown(grace_s=1)


def parts_of(
    config: JobConfig, groups: RoleGroups, worker: WorkerSpec, prompts: PromptStream,
    scorer: Scorer,
) -> RunParts:  # fmt: skip
    """A run's parts around `groups` and `scorer`, its weight transfer not opened."""
    plan = plan_placement(config)
    weights = WeightSync(groups, config.trainer.weight_sync_timeout_seconds)
    metrics = TrainerMetrics(pools=[p.name for p in plan.pools])
    engines = EngineMembership(groups, weights, plan, worker, Replacement.of(config),
                               config.generation.max_engine_restarts, metrics, scorer.timeline)  # fmt: skip
    return RunParts(config, plan, metrics, scorer.timeline, scorer.tokens, prompts, [], groups,
                    weights, engines, scorer, None)  # fmt: skip


def test_a_synchronous_step_offers_each_sample_to_the_reward_service_as_it_finishes(
    ray_pools: RayPools, tmp_path: Path
) -> None:
    """PPOTrainer.generate hands the reward service each sample as its engine yields it,
    not once the batch is generated: the rollout ranks (HeldRollout) hold all but their
    first sample until the service has scored one. A step that offered samples only
    after generation would never send one, and the ranks would fail, naming the
    go-ahead they waited for."""
    go_ahead = tmp_path / "go-ahead"

    def score(prompt: str, response: str) -> float:
        go_ahead.touch()
        return float(response)

    spec = job_manifest()["spec"]
    prompts = [Prompt(text=f"p{k}", token_ids=[k]) for k in range(4)]
    worker = WorkerSpec(HeldRollout, (str(go_ahead),))
    group = WorkerGroup.spawn(
        ray_pools.plan, Role.ROLLOUT, ray_pools.groups["policy"], worker.cls, *worker.args
    )
    with served({"reward": reward_app_for(score)}) as url:
        spec["models"]["reward"] = {"url": f"{url}/reward"}
        config = JobConfig.model_validate(spec)
        groups = RoleGroups({Role.ROLLOUT: group}, ray_pools.groups)
        tokens = Tokens(decode=lambda ids: str(ids[0]), pad_id=0)
        with Scorer.open(config.models.reward, None, groups, tokens, Timeline()) as scorer:
            parts = parts_of(config, groups, worker, PromptStream(prompts, seed=0), scorer)
            trainer = PPOTrainer(parts)
            try:
                join(group.ready)
                batch = trainer.generate(prompts, step=1)
                rewards = scorer.score(batch.prompts, batch.rollouts, None, batch.keys).tolist()
            finally:
                group.shutdown(grace_s=1)
    assert group.world_size == 2  # two ranks, each holding the rest of its samples
    assert [p.token_ids for p in batch.prompts] == [[k] for k in range(4)]
    assert rewards == [k + 100.0 for k in range(4)]


def test_a_tensor_parallel_engines_rank_asks_for_no_gpu_and_its_core_gets_each_bundle(
    ray_pools: RayPools,
) -> None:
    """Pool policy's two GPUs as one engine of TP 2 (docs/concepts/placement.md): its
    rank's process asks Ray for no GPU and is told the engine's bundles, its share and
    the cluster's address; a child process, as vLLM's engine core is, joins the cluster
    there and gets a share of a GPU in each of the two bundles, beside the other roles'
    ranks (tests/unit/test_gpu_shapes.py checks that vLLM's executor asks just this)."""
    from rlhf_trainer.cluster.placement import (
        WorkerSlot,
        engine_environment,
        gpu_share,
        placement_group_name,
    )
    from tests.trainer.toy_workers import TensorParallelRank

    pool = ray_pools.groups["policy"]
    share = gpu_share(next(p for p in ray_pools.plan.pools if p.name == "policy"))
    bundles = tuple(pool.rank_order)
    slot = WorkerSlot("policy", bundles[0], share, engine_bundles=bundles)
    group = WorkerGroup.spawn_ranks(Role.ROLLOUT, [slot], [0], pool, TensorParallelRank)
    try:
        join(group.ready, READY_TIMEOUT_S)
        (seen,) = join(group.run("seen"))
        assert seen["gpus"] == []  # its process asked for none
        address = ray.get_runtime_context().gcs_address
        assert seen["environment"] == engine_environment(slot) | {"RAY_ADDRESS": address}
        name = placement_group_name(job_manifest()["metadata"]["name"], "policy")
        (workers,) = join(group.run("start_engine_core", name), READY_TIMEOUT_S)
        # one GPU each, the two bundles' own: one worker on each GPU of the engine
        assert sorted(len(ids) for ids in workers) == [1, 1]
        assert len({ids[0] for ids in workers}) == 2
    finally:
        group.shutdown()
