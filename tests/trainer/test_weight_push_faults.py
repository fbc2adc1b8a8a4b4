"""Weight pushes that lose an engine, on a real Ray cluster: a head and one node of
pool "sync" (2 logical GPUs), where the toy actor (WeightSender) pushes to two toy
engines over the host transfer through vLLM's factory, as the actor does. An engine
stopped or killed in a push is named; engines lost, or left stuck in the push's
receive, are replaced (synchronous modes) or dropped for new ones (fully async).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
import ray
import ray._private.state as ray_state
import torch
from ray import cluster_utils

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.names import POOL_LABEL, pool_resource
from rlhf_trainer.api.plan import plan_placement
from rlhf_trainer.cluster.engine_client import TransferFailed
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import RanksLost
from rlhf_trainer.cluster.placement import WorkerSlot, create_pool_groups, wait_ready
from rlhf_trainer.cluster.queue import spawn_queue
from rlhf_trainer.cluster.role_groups import RoleGroups, WorkerSpec
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.loop.fully_async import Admissions
from rlhf_trainer.loop.membership import EngineMembership, Event, Replacement
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.weights import EnginesStalled, SyncFailure, WeightSync
from rlhf_trainer.rollout.sync_deadlines import Stall
from rlhf_trainer.rollout.weight_sync import Bucket
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.timeline import Timeline
from rlhf_trainer.worker import RankInfo, Worker
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


def sync_with_a_failing_engine(error: type[Exception], dies: bool) -> tuple[Exception, float]:
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
        return failure.value, time.monotonic() - started
    finally:
        if frozen is not None and not dies:
            os.kill(frozen, signal.SIGKILL)  # a stopped process ends only this way
        groups.shutdown()


def test_a_rank_stopped_in_a_weight_sync_is_named_once_the_start_deadline_passes() -> None:
    """Rollout rank 0 freezes (SIGSTOP) as an update starts. The transfer does not hang:
    past the start's deadline (the floor: it moves no bytes) the actor's rank 0, which
    drives it, fails naming that rank as the one not answering (not rank 1, which
    answered), the phase and the bytes, before the transfer's own collectives would time
    out; the driver raises it as EnginesStalled, rank 0 to replace."""
    error, waited = sync_with_a_failing_engine(EnginesStalled, dies=False)
    assert isinstance(error, EnginesStalled)
    # No bucket sent yet, of one: embed's 48 bytes (aligned to 64), then head's 16.
    assert error.stall == Stall("sync", (0,), "start", 0, 80)
    cause = str(error.__cause__)
    assert "weight transfer, start_weight_update on every engine" in cause
    silent = cause.partition("not answering (stopped, hung, dead or lost):")[2]
    assert "rollout rank 0 on pool sync (start_weight_update)" in silent, cause
    assert "rollout rank 1" not in cause and "actor rank" not in silent, cause
    assert waited >= SYNC_TIMEOUT_S


def test_a_rank_that_dies_in_a_weight_sync_fails_it_at_once_by_name() -> None:
    """Rollout rank 0's process exits at the first bucket: the push fails as the death
    is seen, naming that rank (and not rank 1). Not by a clock: had the push waited out
    the timeout, the error would be NoAnswer (the test above), not TransferFailed."""
    error, _ = sync_with_a_failing_engine(TransferFailed, dies=True)
    message = str(error)
    assert "weight transfer, update_weights: rollout rank 0 on pool sync failed" in message
    assert "rollout rank 1" not in message, message


@dataclass
class LosingPush:
    """Two toy engines (LosingReceiver, or `worker`) in an open weight transfer, and
    their membership once `start`ed; `stuck` is rank 1's actor, `slots` the engines'
    bundles."""

    job: JobConfig
    groups: RoleGroups
    sync: WeightSync
    stuck: Any
    slots: list[WorkerSlot]
    worker: WorkerSpec
    engines: EngineMembership | None = None
    metrics: TrainerMetrics = field(default_factory=TrainerMetrics)

    def start(self, mode: Replacement) -> EngineMembership:
        plan = plan_placement(self.job)
        self.engines = EngineMembership(self.groups, self.sync, plan, self.worker, mode,
                                        self.job.generation.max_engine_restarts,
                                        self.metrics, Timeline())  # fmt: skip
        return self.engines

    @property
    def serving(self) -> list[int]:
        return list(self.groups[Role.ROLLOUT].ranks)

    def check_served(self, version: int = 1) -> None:
        """Every engine that serves has `version` whole."""
        for served, weights in join(self.groups[Role.ROLLOUT].run("serving")):
            assert served == version and weights.keys() == TOY_WEIGHTS.keys()
            for name, tensor in TOY_WEIGHTS.items():
                assert torch.equal(weights[name], tensor), name

    def check_after(self, caplog: pytest.LogCaptureFixture) -> None:
        """Every engine that serves has version 1 whole; only rank 0's bundle counted a
        restart; rank 1 was named stuck, and its process has ended."""
        self.check_served()
        assert self.engines is not None
        assert self.engines.replaced == 2 and self.engines.by_bundle == {self.slots[0]: 1}
        assert "rollout rank 1 on pool sync stuck in the weight transfer" in caplog.text
        wait_until_dead(self.stuck)


@contextmanager
def engines_in_a_push(worker: WorkerSpec) -> Iterator[LosingPush]:
    job = sync_job()
    groups = sync_groups(job, worker.cls, *worker.args)
    try:
        rollout = groups[Role.ROLLOUT]
        sync = WeightSync(groups, SYNC_TIMEOUT_S)
        sync.open()
        yield LosingPush(job, groups, sync, rollout.hosts[1], list(rollout.slots), worker)
    finally:
        groups.shutdown()


@pytest.fixture
def losing_push() -> Iterator[LosingPush]:
    with engines_in_a_push(WorkerSpec(LosingReceiver)) as push:
        yield push


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
    engines = push.start(Replacement.IN_PLACE)
    engines.surviving(lambda: push.sync.push(version=1), "the push", lost_in=Exception)
    assert list(push.groups[Role.ROLLOUT].ranks) == [2, 3]
    push.check_after(caplog)


def test_in_fully_async_engines_left_stuck_by_a_loss_go_with_it(
    losing_push: LosingPush, caplog: pytest.LogCaptureFixture
) -> None:
    """The same push in fully async (EngineMembership.recover): rank 0 is lost, and rank
    1, left stuck, goes too. With no engine left the run waits for rank 3, started in
    rank 1's bundle, and pushes it the current weights; rank 2, started in rank 0's,
    joins later (it is left starting). Only rank 0's bundle counts a restart."""
    push = losing_push
    push.sync.actor_version = 1
    engines = push.start(Replacement.ELASTIC)
    parts = SimpleNamespace(queue=spawn_queue(), metrics=push.metrics, groups=push.groups)
    engines.listen(Admissions(cast(RunParts, parts)))
    with pytest.raises(TransferFailed):
        push.sync.push(version=1)
    engines.recover(Event.LOST, RanksLost(Role.ROLLOUT, "sync", [0]))
    readmitted = push.metrics.registry.get_sample_value("rlhf_samples_readmitted_total")
    assert readmitted == 0  # it owed nothing
    assert list(push.groups[Role.ROLLOUT].ranks) == [3]
    assert [list(group.ranks) for group in engines.joining] == [[2]]
    push.check_after(caplog)


# Losses that the machine meets while it mends another. Each fault lands on an event:
# a rank dies at the n-th call of one of its methods (FaultyReceiver).


class FaultyReceiver(LosingReceiver):
    """A toy engine that dies (its process exits, as a crashed engine's does) where
    `faults` says for its rank: "start" (as it starts), "update" (at a push's first
    bucket), or "abandon N" (at its N-th close of a push's update, which each setting
    up of the transfer begins with); or stalls, alive, in a push's "stall bucket" or
    "stall finish". Otherwise it takes every push."""

    def __init__(self, info: RankInfo, faults: dict[int, str]) -> None:
        if faults.get(info.rank) == "start":
            os._exit(1)
        super().__init__(info)
        self.fault = faults.get(info.rank, "")
        self.abandons = 0

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.fault == "update":
            os._exit(1)
        self.stall_if("stall bucket")
        bucket = Bucket.from_dict(update_info)
        if self.relay is not None:
            bucket = self.relay.receive(bucket)
        self.loaded |= {name: view.clone() for name, view in self.segments.read(bucket)}

    def finish_weight_update(self, weight_version: int) -> None:
        self.stall_if("stall finish")
        super().finish_weight_update(weight_version)

    def stall_if(self, fault: str) -> None:
        """Alive (it answers pings) but never done: only its process's end ends it."""
        if self.fault == fault:
            threading.Event().wait()

    def abandon_weight_update(self) -> None:
        self.abandons += 1
        if self.fault == f"abandon {self.abandons}":
            os._exit(1)
        super().abandon_weight_update()


def faulty(**faults: str) -> Iterator[LosingPush]:
    """Two FaultyReceivers with `faults` by rank (r0=..., r2=...)."""
    by_rank = {int(rank[1:]): fault for rank, fault in faults.items()}
    return engines_in_a_push(WorkerSpec(FaultyReceiver, (by_rank,)))


MODES = pytest.mark.parametrize("mode", list(Replacement))


@MODES
def test_a_second_loss_while_a_loss_is_mended_is_mended_too(mode: Replacement) -> None:
    """Rank 0 dies in a push; rank 1 dies as the transfer is set up again without it
    (synchronous: once rank 0's replacement is up). Both are replaced, each counted
    in its own bundle, and the push is made again: every engine serves it whole."""
    with faulty(r0="update", r1="abandon 1") as push:
        engines = push.start(mode)
        engines.surviving(lambda: push.sync.push(version=1), "the push", lost_in=Exception)
        assert engines.by_bundle == {push.slots[0]: 1, push.slots[1]: 1}
        if mode is Replacement.IN_PLACE:
            assert push.serving == [2, 3]
        else:  # none left once rank 1 went: rank 3 is waited for; rank 2 joins later
            assert push.serving == [3] and [list(g.ranks) for g in engines.joining] == [[2]]
        push.check_served()


@MODES
def test_a_replacement_that_dies_as_it_starts_is_replaced_in_its_slot(mode: Replacement) -> None:
    """Rank 0 dies in a push, and the replacement the run waits for dies as it starts
    (synchronous: rank 2, in rank 0's bundle; fully async, once rank 1 is lost too and
    none is left: rank 3, in rank 1's). It is replaced in its slot, counted there."""
    sync = mode is Replacement.IN_PLACE
    faults = (
        {"r0": "update", "r2": "start"}
        if sync
        else {"r0": "update", "r1": "abandon 1", "r3": "start"}
    )
    with faulty(**faults) as push:
        engines = push.start(mode)
        engines.surviving(lambda: push.sync.push(version=1), "the push", lost_in=Exception)
        if sync:
            assert push.serving == [3, 1] and engines.by_bundle == {push.slots[0]: 2}
        else:
            assert push.serving == [4] and engines.by_bundle == {push.slots[0]: 1, push.slots[1]: 2}
        push.check_served()


@pytest.mark.parametrize(("phase", "moved"), [("bucket", 0), ("finish", 80)])
def test_an_engine_that_stalls_in_a_phase_is_named_and_replaced(
    phase: str, moved: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Rollout rank 0 stops making progress (alive: it answers pings) as the push's
    `phase` begins: on that event. Past the phase's deadline the push fails naming rank
    0, the phase and the bytes moved of the push's 80 (one bucket: embed's 48 bytes,
    aligned to 64, then head's 16). The membership takes it as lost: it is shut down and
    replaced in its bundle (counted there), the push made again, and every engine
    serves the version whole. The failed sync is counted by its phase."""
    with faulty(r0=f"stall {phase}") as push:
        engines = push.start(Replacement.IN_PLACE)
        engines.surviving(lambda: push.sync.push(version=1), "the push", lost_in=Exception)
        assert push.serving == [2, 1] and engines.by_bundle == {push.slots[0]: 1}
        push.check_served()
        stall = Stall("sync", (0,), phase, moved, 80)
        assert engines.last_failed_sync == SyncFailure(phase, str(stall))
        assert f"{stall}: replaced as lost" in caplog.text
        registry = push.metrics.registry
        assert registry.get_sample_value("rlhf_weight_sync_failures_total", {"phase": phase}) == 1


def test_an_engine_lost_as_others_join_is_dropped_and_the_joiners_serve() -> None:
    """Fully async: rank 0 is lost (killed) and dropped; rank 2 starts in its bundle,
    and once it is up, joins. As the transfer is set up again for the three, rank 1
    dies: it is dropped in turn, and rank 2 serves (rank 3 starts in rank 1's bundle)."""
    with faulty(r1="abandon 2") as push:
        engines = push.start(Replacement.ELASTIC)
        ray.kill(push.groups[Role.ROLLOUT].hosts[0])
        wait_until_dead(push.groups[Role.ROLLOUT].hosts[0])
        engines.drop_dead()
        (starting,) = engines.joining
        join(starting.ready)  # up: the event the join waits for
        joining = engines.ready_to_join()
        assert joining is not None and list(joining.ranks) == [2]
        engines.join(joining)
        assert push.serving == [2] and [list(g.ranks) for g in engines.joining] == [[3]]
        assert engines.by_bundle == {push.slots[0]: 1, push.slots[1]: 1}
        push.sync.actor_version = 1
        push.sync.push(version=1)
        push.check_served()


def test_a_close_that_raises_at_the_end_of_a_run_leaves_no_actor_or_placement_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run's parts, of toy roles (a fully-async job: its queue too), closed after
    the engines' stats poller fails to stop: the error is raised, and every close after
    it ran: Ray's tables hold no live actor and no placement group not removed."""
    from rlhf_trainer.cluster.engine_stats import EngineStatsPoller
    from rlhf_trainer.loop import setup

    config = sync_job()
    monkeypatch.setattr(setup, "sample_queue", lambda _: spawn_queue())  # as fully async's
    monkeypatch.setattr(setup.RoleGroups, "start", lambda *_: sync_groups(config, LosingReceiver))
    stop = EngineStatsPoller.stop

    def stop_that_fails(poller: EngineStatsPoller) -> None:
        stop(poller)
        raise RuntimeError("the poller would not stop")

    monkeypatch.setattr(EngineStatsPoller, "stop", stop_that_fails)
    actors_before, groups_before = live_actors(), placed_groups()
    with (
        pytest.raises(RuntimeError, match="would not stop"),
        setup.open_parts(config, "end") as parts,
    ):
        assert parts.queue is not None and parts.groups[Role.ROLLOUT].world_size == 2
        assert live_actors() - actors_before and placed_groups() - groups_before
    assert live_actors() - actors_before == set()
    assert placed_groups() - groups_before == set()


def live_actors() -> set[str]:
    """The actors Ray's state tables (the GCS's) hold alive or starting."""
    return {key for key, actor in ray_state.actors().items() if actor["State"] != "DEAD"}


def placed_groups() -> set[str]:
    """The placement groups Ray's state tables hold, not removed."""
    table = ray.util.placement_group_table()
    return {key for key, group in table.items() if group["state"] != "REMOVED"}
