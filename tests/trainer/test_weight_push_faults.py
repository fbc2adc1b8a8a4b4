"""Weight pushes that lose an engine, on a real Ray cluster: a head and one node of
pool "sync" (2 logical GPUs), where the toy actor (WeightSender) pushes to two toy
engines over the host transfer through vLLM's factory, as the actor does. An engine
stopped or killed in a push is named; engines lost, or left stuck in the push's
receive, are replaced (synchronous modes) or dropped for new ones (fully async).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest
import ray
import torch
from ray import cluster_utils

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.names import POOL_LABEL, pool_resource
from rlhf_trainer.api.plan import plan_placement
from rlhf_trainer.cluster.engine_client import TransferFailed
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import NoAnswer, RanksLost
from rlhf_trainer.cluster.placement import WorkerSlot, create_pool_groups, wait_ready
from rlhf_trainer.cluster.queue import spawn_queue
from rlhf_trainer.cluster.role_groups import RoleGroups, WorkerSpec
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.loop.elastic_rollout import ElasticRollout
from rlhf_trainer.loop.engine_replacement import EngineReplacement
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import PPOTrainer
from rlhf_trainer.loop.weights import WeightSync
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.timeline import Timeline
from rlhf_trainer.worker import Worker
from tests.trainer.toy_workers import (
    TOY_WEIGHTS,
    LosingReceiver,
    StoppingReceiver,
    WeightSender,
    wait_until_dead,
)
from tests.unit.conftest import EXAMPLES, load

READY_TIMEOUT_S = 120  # generous: other test runs share this machine's two cores


@pytest.fixture(scope="module", autouse=True)
def sync_cluster() -> Iterator[None]:
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0}
    )
    try:
        cluster.add_node(
            num_cpus=0,
            num_gpus=2,
            resources={pool_resource("sync"): 2},
            labels={POOL_LABEL: "sync"},
        )
        ray.init(address=cluster.address, include_dashboard=False)
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


SYNC_TIMEOUT_S = 5.0


def sync_job() -> JobConfig:
    """A job with every role on pool "sync" (2 GPUs: the actor and two engines)."""
    manifest = load(EXAMPLES[0].parent / "local-cpu.yaml")
    manifest["spec"]["pools"] = [{"name": "sync", "gpusPerNode": 2}]
    manifest["spec"]["roles"] = {role: "sync" for role in ("actor", "rollout", "ref", "critic")}
    return parse_job(manifest).spec


def sync_groups(job: JobConfig, receiver: type[Worker], *args: Any) -> RoleGroups:
    """The toy actor (WeightSender) and two toy engines (`receiver`) of `job`, up."""
    plan = plan_placement(job)
    pools = wait_ready(create_pool_groups(plan, "sync"), READY_TIMEOUT_S)
    groups = RoleGroups(
        {Role.ACTOR: WorkerGroup.spawn(plan, Role.ACTOR, pools["sync"], WeightSender)}
        | {Role.ROLLOUT: WorkerGroup.spawn(plan, Role.ROLLOUT, pools["sync"], receiver, *args)},
        pools,
    )
    try:
        join([ready for group in groups.groups.values() for ready in group.ready])
    except BaseException:
        groups.shutdown()
        raise
    return groups


def sync_with_a_failing_engine(error: type[Exception], dies: bool) -> tuple[str, float]:
    """One weight push to two toy engines on one pool, rank 0 of which stops or dies in
    it; the error the driver gets, and how long it took."""
    groups = sync_groups(sync_job(), StoppingReceiver, 0, dies)
    frozen = None
    try:
        frozen = join(groups[Role.ROLLOUT].run("pid"))[0]
        sync = WeightSync(groups, SYNC_TIMEOUT_S)
        sync.open()
        started = time.monotonic()
        with pytest.raises(error) as failure:
            sync.push(version=1)
        return str(failure.value), time.monotonic() - started
    finally:
        if frozen is not None and not dies:
            os.kill(frozen, signal.SIGKILL)  # a stopped process ends only this way
        groups.shutdown()


def test_a_rank_stopped_in_a_weight_sync_is_named_once_the_timeout_passes() -> None:
    """Rollout rank 0 freezes (SIGSTOP) as an update starts. The transfer does not hang:
    after the timeout the actor's rank 0, which drives it, fails naming that rank as the
    one not answering (not rank 1, which answered), before the transfer's own
    collectives would time out (NoAnswer is the engine calls' wait; the collectives'
    would be a gloo error), and the driver gets that error."""
    message, waited = sync_with_a_failing_engine(NoAnswer, dies=False)
    assert "weight transfer, start_weight_update on every engine" in message
    silent = message.partition("not answering (stopped, hung, dead or lost):")[2]
    assert "rollout rank 0 on pool sync (start_weight_update)" in silent, message
    assert "rollout rank 1" not in message and "actor rank" not in silent, message
    assert waited >= SYNC_TIMEOUT_S


def test_a_rank_that_dies_in_a_weight_sync_fails_it_at_once_by_name() -> None:
    """Rollout rank 0's process exits at the first bucket: the push fails as the death
    is seen, naming that rank (and not rank 1). Not by a clock: had the push waited out
    the timeout, the error would be NoAnswer (the test above), not TransferFailed."""
    message, _ = sync_with_a_failing_engine(TransferFailed, dies=True)
    assert "weight transfer, update_weights: rollout rank 0 on pool sync failed" in message
    assert "rollout rank 1" not in message, message


@dataclass
class LosingPush:
    """Two toy engines (LosingReceiver) in an open weight transfer, and their
    replacement; `stuck` is rank 1's actor, `slots` the engines' bundles."""

    groups: RoleGroups
    sync: WeightSync
    engines: EngineReplacement
    stuck: Any
    slots: list[WorkerSlot]

    def check_after(self, caplog: pytest.LogCaptureFixture) -> None:
        """Every engine that serves has version 1 whole; only rank 0's bundle counted a
        restart; rank 1 was named stuck, and its process has ended."""
        for version, weights in join(self.groups[Role.ROLLOUT].run("serving")):
            assert version == 1 and weights.keys() == TOY_WEIGHTS.keys()
            for name, tensor in TOY_WEIGHTS.items():
                assert torch.equal(weights[name], tensor), name
        assert self.engines.replaced == 2 and self.engines.by_bundle == {self.slots[0]: 1}
        assert "rollout rank 1 on pool sync stuck in the weight transfer" in caplog.text
        wait_until_dead(self.stuck)


@pytest.fixture
def losing_push() -> Iterator[LosingPush]:
    job = sync_job()
    groups = sync_groups(job, LosingReceiver)
    try:
        rollout = groups[Role.ROLLOUT]
        sync = WeightSync(groups, SYNC_TIMEOUT_S)
        sync.open()
        engines = EngineReplacement(job, groups, sync, WorkerSpec(LosingReceiver))
        yield LosingPush(groups, sync, engines, rollout.hosts[1], list(rollout.slots))
    finally:
        groups.shutdown()


def test_engines_left_stuck_in_a_push_that_lost_one_are_replaced_too(
    losing_push: LosingPush, caplog: pytest.LogCaptureFixture
) -> None:
    """Rollout rank 0 dies at the push's first bucket, and rank 1 stays in its receive
    (a stand-in for NCCL's, which no abort ends: LosingReceiver). The push is made
    again on two new engines: rank 2 in rank 0's bundle, and rank 3 in rank 1's, once
    rank 1 has not closed the failed update within the timeout. Both serve the
    version whole; only rank 0's bundle counts a restart, and rank 1's process is
    ended (on a GPU, so are its engine's GPU memory and communicator)."""
    push = losing_push
    push.engines.surviving(lambda: push.sync.push(version=1), lost_in=Exception)
    assert list(push.groups[Role.ROLLOUT].ranks) == [2, 3]
    push.check_after(caplog)


def test_in_fully_async_engines_left_stuck_by_a_loss_go_with_it(
    losing_push: LosingPush, caplog: pytest.LogCaptureFixture
) -> None:
    """The same push in fully async (ElasticRollout.lose): rank 0 is lost, and rank 1,
    left stuck, goes too. With no engine left the run waits for rank 3, started in
    rank 1's bundle, and pushes it the current weights; rank 2, started in rank 0's,
    joins later (it is left starting). Only rank 0's bundle counts a restart."""
    push = losing_push
    core = SimpleNamespace(groups=push.groups, weight_sync=push.sync, engines=push.engines,
                           timeline=Timeline(), policy_version=1)  # fmt: skip
    parts = SimpleNamespace(queue=spawn_queue(), metrics=TrainerMetrics(), engines=push.engines)
    elastic = ElasticRollout(cast(PPOTrainer, core), cast(RunParts, parts))
    with pytest.raises(TransferFailed):
        push.sync.push(version=1)
    assert elastic.lose(RanksLost(Role.ROLLOUT, "sync", [0])) == []  # it owed nothing
    assert list(push.groups[Role.ROLLOUT].ranks) == [3]
    assert [list(group.ranks) for group in elastic.joining] == [[2]]
    push.check_after(caplog)
