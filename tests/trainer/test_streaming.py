"""Fully async streaming: prompt admission, the sample queue, and the queue as a Ray actor."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_env.rewards import RewardClient, ScoredSample, ScoreRequest, reward_app_for
from rlhf_trainer.algo.experience import Episode, Rollout
from rlhf_trainer.cluster.queue import spawn_queue
from rlhf_trainer.loop.background_starts import start_retry_delay
from rlhf_trainer.loop.fully_async import AsyncState, EngineLedger
from rlhf_trainer.loop.scores_ahead import QueueArrivals, ScoresAhead
from rlhf_trainer.rollout.queue import (
    MIN_REMEMBERED_UIDS,
    AdmissionControl,
    QueueClosed,
    RolloutFailed,
    SampleQueue,
    admission_limit,
    remembered_uids,
)
from rlhf_trainer.rollout.samples import Sample, group_staleness, staleness
from tests.environments import served

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WAIT_S = 60.0  # upper bound for things that should happen at once (shared, busy machine)

batch_sizes = st.integers(min_value=1, max_value=64)
sync_steps = st.integers(min_value=1, max_value=16)
# Staleness as written in a config: up to 16 (the spec's bound), with a few decimals.
stalenesses = st.one_of(
    st.just(0.0),
    st.decimals(min_value=0, max_value=16, places=3).map(float),
    st.floats(min_value=0, max_value=16, allow_nan=False, allow_infinity=False),
)


def sample(uid: int, prompt_index: int = 0, version: int = 0, **kwargs: Any) -> Sample:
    rollout = Rollout(
        prompt_token_ids=[1, 2, uid % 7],
        response_token_ids=[3, uid % 11, 4],
        response_log_probs=[-0.5, -1.25 - uid / 1000, -0.1],
        finished=uid % 2 == 0,
        policy_version=version,
        version_spans=((version, 0), (version + 1, 2)),  # a partial rollout over a sync
    )
    return Sample(uid=uid, prompt_index=prompt_index, rollout=rollout, **kwargs)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


# ---- admission -----------------------------------------------------------------------


@SETTINGS
@given(batch_sizes, sync_steps, stalenesses)
def test_limit_is_the_rounded_down_exact_product(b: int, k: int, s: float) -> None:
    control = AdmissionControl(b, k, s)
    exact = b * k * (1 + Fraction(repr(s)))
    assert control.limit == math.floor(exact)
    assert b * k <= control.limit <= exact < control.limit + 1


@pytest.mark.parametrize(
    ("b", "k", "s", "limit"),
    [
        (4, 2, 0.5, 12),
        (4, 2, 0.0, 8),
        (3, 1, 0.1, 3),  # 3.3 rounds down
        (10, 1, 0.7, 17),
        (25, 1, 0.16, 29),  # float arithmetic says 28.999999999999996
        (5, 3, 7.2, 123),  # and 122.99999999999999
        (1, 1, 16, 17),
        (2, 3, 1, 12),
    ],
)
def test_limit_examples(b: int, k: int, s: float, limit: int) -> None:
    assert AdmissionControl(b, k, s).limit == limit


@SETTINGS
@given(
    batch_sizes,
    sync_steps,
    stalenesses,
    st.lists(st.one_of(st.just("sync"), st.integers(min_value=1, max_value=300)), max_size=20),
)
def test_never_more_than_the_limit_between_syncs(
    b: int, k: int, s: float, ops: list[str | int]
) -> None:
    control = AdmissionControl(b, k, s)
    since_sync = total = 0
    for op in ops:
        if op == "sync":
            control.on_weight_sync()
            since_sync = 0
            continue
        assert isinstance(op, int)
        for _ in range(op):
            admitted = control.try_admit()
            assert admitted == (since_sync < control.limit)
            since_sync += admitted
            total += admitted
            assert control.admitted_since_sync == since_sync <= control.limit
    assert control.admitted_total == total


@SETTINGS
@given(batch_sizes, sync_steps, stalenesses, st.integers(min_value=0, max_value=100))
def test_exactly_the_limit_when_asked_for_more(b: int, k: int, s: float, extra: int) -> None:
    control = AdmissionControl(b, k, s)
    for _round in range(2):  # and again after a sync
        admitted = sum(control.try_admit() for _ in range(control.limit + extra))
        assert admitted == control.limit
        control.on_weight_sync()


@SETTINGS
@given(batch_sizes, sync_steps)
def test_no_staleness_admits_one_sync_interval_of_batches(b: int, k: int) -> None:
    control = AdmissionControl(b, k, 0)
    assert control.limit == b * k
    assert sum(control.try_admit() for _ in range(3 * b * k)) == b * k


@SETTINGS
@given(batch_sizes, sync_steps, stalenesses, st.integers(0, 200), st.integers(0, 200))
def test_admission_state_round_trip(b: int, k: int, s: float, before: int, after: int) -> None:
    control = AdmissionControl(b, k, s)
    for i in range(before):
        control.try_admit()
        if i % 97 == 96:
            control.on_weight_sync()
    resumed = AdmissionControl(b, k, s)
    resumed.restore(json.loads(json.dumps(control.state())))
    assert resumed.state() == control.state()
    assert [resumed.try_admit() for _ in range(after)] == [
        control.try_admit() for _ in range(after)
    ]
    assert resumed.state() == control.state()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 0.5), "batch_size"),
        ((1, 0, 0.5), "sync_every"),
        ((1, 1, -0.1), "staleness"),
        ((1, 1, float("nan")), "staleness"),
    ],
)
def test_admission_rejects_bad_settings(args: tuple[int, int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdmissionControl(*args)


def test_admission_restore_rejects_inconsistent_state() -> None:
    with pytest.raises(ValueError, match="inconsistent"):
        AdmissionControl(2, 1, 0).restore({"admitted_since_sync": 3, "admitted_total": 2})


# ---- samples -------------------------------------------------------------------------


def test_staleness_counts_from_the_oldest_generating_version() -> None:
    assert staleness(sample(0, version=3), 3) == 0
    assert staleness(sample(0, version=3), 5) == 2
    partial = sample(0, version=4, policy_versions=(2, 3, 4))  # resumed across syncs
    assert partial.oldest_version == 2
    assert staleness(partial, 4) == 2
    with pytest.raises(ValueError, match="newer than the trained version"):
        staleness(sample(7, version=6), 5)


def test_sample_defaults_to_its_rollouts_version() -> None:
    assert sample(0, version=9).policy_versions == (9,)


def test_sample_json_round_trip() -> None:
    original = sample(12, prompt_index=34, version=5, policy_versions=(4, 5))
    assert Sample.from_json(json.loads(json.dumps(original.to_json()))) == original


def test_a_multi_turn_sample_keeps_its_loss_mask_and_episode_through_json() -> None:
    episode = Episode(score=0.5, turns=2, tool_calls=1, version_span=1, cut=None)
    original = Sample(
        3,
        7,
        Rollout([1], [7, 2, 4, 8, 2], [-0.1, -0.2, 0.0, -0.3, -0.4], True, 4,
                ((4, 0), (5, 3)), loss_mask=(1, 1, 0, 1, 1), episode=episode),
    )  # fmt: skip
    assert Sample.from_json(json.loads(json.dumps(original.to_json()))) == original


def test_async_checkpoint_state_json_round_trip() -> None:
    state = AsyncState(
        admission={"admitted_since_sync": 3, "admitted_total": 17},
        queued=[sample(14, version=2), sample(15, prompt_index=8, version=3)],
        in_flight=[(16, 9, [1, 5, 6]), (17, 9, {"key": "c", "value": "x"})],  # a multi-turn row
    )
    assert AsyncState.from_json(json.loads(json.dumps(state.to_json()))) == state


# ---- the queue -----------------------------------------------------------------------


def test_fifo_in_exact_batches() -> None:
    queue = SampleQueue()
    for uid in range(7):
        assert queue.put(sample(uid)) == uid + 1
    first = queue.get_batch(3, timeout_s=0)
    second = queue.get_batch(3, timeout_s=0)
    assert first is not None and second is not None
    assert [s.uid for s in first] == [0, 1, 2]
    assert [s.uid for s in second] == [3, 4, 5]
    assert queue.depth() == 1


def test_a_sample_generated_twice_is_queued_once_and_owed_uids_are_those_never_put() -> None:
    """A lost engine's prompt is generated again elsewhere; if its first answer was
    delivered after all (before or after the second), only one is queued and trained."""
    queue = SampleQueue()
    queue.put(sample(0))
    assert queue.get_batch(1, timeout_s=0) is not None  # trained already
    queue.put(sample(1))  # queued
    assert queue.not_received([0, 1, 2, 3]) == [2, 3]  # what a lost engine still owed
    for uid in (2, 0, 1, 2):  # 2 from its second engine, then late first answers
        queue.put(sample(uid))
    assert queue.depth() == 2
    batch = queue.get_batch(2, timeout_s=0)
    assert batch is not None and [s.uid for s in batch] == [1, 2]


def test_the_uids_remembered_follow_the_jobs_sizes_and_are_all_that_is_remembered() -> None:
    """A big job outgrows the fixed window the queue once had: 4096 samples a step, a sync
    every 4, staleness 1, groups of 8 admit 32,768 groups an interval (262,144 samples)."""
    assert remembered_uids(admission_limit(32, 1, 0.5), 1) == MIN_REMEMBERED_UIDS
    big = admission_limit(4096, 4, 1.0)
    assert big == 32_768 and remembered_uids(big, 8) == 4 * 32_768 * 8
    queue = SampleQueue(remembered=3)
    for uid in range(5):
        queue.put(sample(uid))
    assert queue.not_received(range(5)) == [0, 1]  # forgotten: older than the last 3
    for uid in (4, 2, 1):  # within the window: dropped; older: queued again
        queue.put(sample(uid))
    assert queue.depth() == 6


def test_ledger_knows_what_each_engine_holds_until_it_is_taken() -> None:
    ledger = EngineLedger()
    ledger.assign([0, 2], [[(0, 5, [1]), (1, 6, [2])], [(2, 7, [3])]])
    ledger.taken([1])
    assert ledger.held_by([0]) == [0] and ledger.held_by([2]) == [2]
    assert ledger.admitted([0, 2]) == [(0, 5, [1]), (2, 7, [3])]
    ledger.assign([2], [[(0, 5, [1])]])  # given to engine 2 instead
    assert ledger.held_by([0]) == [] and ledger.held_by([2]) == [0, 2]
    assert len(ledger) == 2


def test_engines_that_could_not_start_wait_longer_at_each_failure_up_to_a_limit() -> None:
    delays = [start_retry_delay(failures) for failures in range(1, 8)]
    assert delays == [30, 60, 120, 240, 480, 600, 600]


def test_never_a_partial_batch() -> None:
    queue = SampleQueue()
    for uid in range(3):
        queue.put(sample(uid))
    assert queue.get_batch(4, timeout_s=0.05) is None  # timed out: nothing taken
    assert queue.depth() == 3
    queue.put(sample(3))
    batch = queue.get_batch(4, timeout_s=0)
    assert batch is not None and [s.uid for s in batch] == [0, 1, 2, 3]
    assert queue.depth() == 0


def test_batch_size_must_be_positive_and_whole_groups() -> None:
    with pytest.raises(ValueError, match="whole groups of 1 samples, got size 0"):
        SampleQueue().get_batch(0, timeout_s=0)
    with pytest.raises(ValueError, match="whole groups of 3 samples, got size 4"):
        SampleQueue(group_size=3).get_batch(4, timeout_s=0)


def test_groups_are_held_back_until_whole_and_handed_out_whole_in_completion_order() -> None:
    queue = SampleQueue(group_size=3)  # group g holds the uids 3g, 3g+1, 3g+2
    for uid in (0, 4, 1, 5, 3):  # group 1 completes first; group 0 still misses uid 2
        queue.put(sample(uid))
    assert queue.depth() == 5  # partial groups count: they are outstanding
    assert queue.get_batch(6, timeout_s=0.05) is None  # one whole group is not two
    batch = queue.get_batch(3, timeout_s=0)
    assert batch is not None and [s.uid for s in batch] == [3, 4, 5]
    queue.put(sample(2))
    batch = queue.get_batch(3, timeout_s=0)
    assert batch is not None and [s.uid for s in batch] == [0, 1, 2]  # sorted within
    assert queue.depth() == 0


def test_a_snapshot_keeps_partial_groups_and_a_restore_makes_them_whole_again() -> None:
    queue = SampleQueue(group_size=2)
    for uid in (0, 1, 3):  # group 0 whole, group 1 half
        queue.put(sample(uid))
    snapshot = queue.snapshot()
    assert [s.uid for s in snapshot] == [0, 1, 3]
    resumed = SampleQueue(group_size=2)
    resumed.restore(snapshot)
    assert resumed.depth() == 3
    assert resumed.get_batch(4, timeout_s=0.05) is None  # group 1 is still half
    resumed.put(sample(2))
    batch = resumed.get_batch(4, timeout_s=0)
    assert batch is not None and [s.uid for s in batch] == [0, 1, 2, 3]


def test_a_group_is_as_stale_as_its_oldest_sample() -> None:
    samples = [
        sample(0, version=3),
        sample(1, version=1),
        sample(2, version=3),
        sample(3, version=3),
    ]
    assert group_staleness(samples, 4, group_size=2) == [3, 3, 1, 1]
    assert group_staleness(samples, 4, group_size=1) == [1, 3, 1, 1]


def test_a_blocked_getter_takes_its_batch_once_it_fills() -> None:
    queue = SampleQueue()
    result: list[list[Sample] | None] = []
    getter = threading.Thread(target=lambda: result.append(queue.get_batch(3)), daemon=True)
    getter.start()
    wait_until(lambda: queue.waiting_getters() == 1, "the getter to block")
    for uid in range(2):
        queue.put(sample(uid))
    assert queue.waiting_getters() == 1 and not result  # two samples are not a batch
    queue.put(sample(2))
    getter.join(WAIT_S)
    assert not getter.is_alive()
    assert result[0] is not None and [s.uid for s in result[0]] == [0, 1, 2]


def test_many_producers_one_consumer_exactly_once_in_producer_order() -> None:
    producers, per_producer, batch = 4, 150, 8  # 600 samples = 75 batches
    queue = SampleQueue()
    consumed: list[Sample] = []

    def produce(p: int) -> None:
        for i in range(per_producer):
            queue.put(sample(p * per_producer + i, prompt_index=p))

    def consume() -> None:
        for _ in range(producers * per_producer // batch):
            got = queue.get_batch(batch, timeout_s=WAIT_S)
            assert got is not None and len(got) == batch
            consumed.extend(got)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    consumer.join(WAIT_S)
    assert not consumer.is_alive()
    uids = [s.uid for s in consumed]
    assert sorted(uids) == list(range(producers * per_producer))  # each exactly once
    for p in range(producers):
        mine = [s.uid for s in consumed if s.prompt_index == p]
        assert mine == sorted(mine)
    assert queue.depth() == 0


def test_close_wakes_a_blocked_getter_with_none() -> None:
    queue = SampleQueue()
    queue.put(sample(0))
    result: list[list[Sample] | None] = []
    getter = threading.Thread(target=lambda: result.append(queue.get_batch(2)), daemon=True)
    getter.start()
    wait_until(lambda: queue.waiting_getters() == 1, "the getter to block")
    queue.close()
    getter.join(WAIT_S)
    assert not getter.is_alive()
    assert result == [None]
    assert queue.get_batch(1, timeout_s=0) is None
    assert [s.uid for s in queue.snapshot()] == [0]  # left queued, for a checkpoint
    with pytest.raises(QueueClosed):
        queue.put(sample(1))


def test_a_rollout_failure_wakes_a_blocked_getter_with_the_reason() -> None:
    queue = SampleQueue()
    errors: list[Exception] = []

    def get() -> None:
        try:
            queue.get_batch(2)
        except RolloutFailed as error:
            errors.append(error)

    getter = threading.Thread(target=get, daemon=True)
    getter.start()
    wait_until(lambda: queue.waiting_getters() == 1, "the getter to block")
    queue.fail("rollout rank 0, sample 7: EngineDeadError()")
    getter.join(WAIT_S)
    assert not getter.is_alive()
    assert [str(e) for e in errors] == ["rollout rank 0, sample 7: EngineDeadError()"]
    queue.put(sample(0))
    with pytest.raises(RolloutFailed, match="sample 7"):
        queue.get_batch(1)  # a full batch too: the run cannot go on


def test_snapshot_restore_round_trip_loses_and_replays_nothing() -> None:
    queue = SampleQueue()
    for uid in range(10):
        queue.put(sample(uid, prompt_index=uid * 3, version=uid // 4))
    trained = queue.get_batch(4, timeout_s=0)  # a step before the checkpoint
    assert trained is not None
    saved = json.loads(json.dumps(queue.snapshot_json()))  # between steps
    assert queue.depth() == 6  # a snapshot takes nothing

    resumed = SampleQueue()
    resumed.restore_json(saved)
    resumed.put(sample(10))  # the rollouter carries on after the restore
    rest = resumed.get_batch(7, timeout_s=0)
    assert rest is not None
    assert rest == [*queue.snapshot(), sample(10)]
    assert sorted(s.uid for s in trained + rest) == list(range(11))


def test_restore_only_into_an_empty_queue_and_without_repeats() -> None:
    queue = SampleQueue()
    with pytest.raises(ValueError, match="repeat uids"):
        queue.restore([sample(1), sample(1)])
    queue.put(sample(5))
    with pytest.raises(ValueError, match="already holds 1 samples"):
        queue.restore([sample(1)])


def test_arrivals_are_read_once_in_order_and_a_restore_counts_as_arriving() -> None:
    queue = SampleQueue(group_size=2, keep_arrivals=True)
    queue.restore([sample(0)])  # a partial group, from a checkpoint
    for uid in (5, 1, 4):
        queue.put(sample(uid))
    queue.put(sample(5))  # generated twice: queued once, arrives once
    arrived, read = queue.arrivals(0, timeout_s=0)
    assert ([s.uid for s in arrived], read) == ([0, 5, 1, 4], 4)
    assert queue.arrivals(read, timeout_s=0) == ([], 4)
    with pytest.raises(ValueError, match="arrivals after 2: those are handed out already"):
        queue.arrivals(2, timeout_s=0)
    with pytest.raises(ValueError, match="keeps no arrivals"):
        SampleQueue().arrivals(0, timeout_s=0)


def test_a_blocked_reader_of_arrivals_wakes_at_a_put_and_at_close() -> None:
    queue = SampleQueue(keep_arrivals=True)
    read: list[tuple[list[Sample], int]] = []
    reader = threading.Thread(target=lambda: read.append(queue.arrivals(0, WAIT_S)))
    reader.start()
    queue.put(sample(3))
    reader.join(WAIT_S)
    assert [([s.uid for s in arrived], n) for arrived, n in read] == [([3], 1)]
    reader = threading.Thread(target=lambda: read.append(queue.arrivals(1, WAIT_S)))
    reader.start()
    queue.close()
    reader.join(WAIT_S)
    assert not reader.is_alive() and read[-1] == ([], 1)


# ---- the queue as a Ray actor --------------------------------------------------------

RAY_SAMPLES, RAY_GETTERS = 12, 2


@pytest.fixture(scope="module")
def ray_module() -> Iterator[Any]:
    import ray

    # "local": a Ray of its own, never a cluster another process runs on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def produce_into(queue: Any, uids: list[int]) -> int:
    """Runs as a Ray task, in a worker process: put each sample, waiting for each put so
    that they queue in order (a threaded actor does not keep submission order)."""
    import ray

    for uid in uids:
        ray.get(queue.put.remote(sample(uid, prompt_index=uid)))
    return len(uids)


def actor_node(_actor: SampleQueue) -> str:
    import ray

    node: str = ray.get_runtime_context().get_node_id()
    return node


def test_ray_queue(ray_module: Any) -> None:
    """One actor for the whole story: each new actor process imports torch (for
    Rollout), which takes seconds on this machine."""
    ray = ray_module
    queue = spawn_queue(max_concurrency=4)
    assert ray.get(queue.__ray_call__.remote(actor_node)) == (
        ray.get_runtime_context().get_node_id()
    )

    # Getters block in the actor, and it still answers other calls.
    batch = RAY_SAMPLES // RAY_GETTERS
    gets = [queue.get_batch.remote(batch, WAIT_S) for _ in range(RAY_GETTERS)]
    wait_until(
        lambda: ray.get(queue.waiting_getters.remote()) == RAY_GETTERS, "the getters to block"
    )
    ready, _ = ray.wait(gets, timeout=0)
    assert not ready

    # Samples put from another process reach them, each exactly once, in order.
    producer = ray.remote(produce_into).options(num_cpus=1)
    assert ray.get(producer.remote(queue, list(range(RAY_SAMPLES))), timeout=WAIT_S) == RAY_SAMPLES
    batches = ray.get(gets, timeout=WAIT_S)
    assert all(b is not None and len(b) == batch for b in batches)
    uids = sorted([s.uid for s in b] for b in batches)
    assert uids == [list(range(batch)), list(range(batch, RAY_SAMPLES))]
    assert ray.get(queue.depth.remote()) == 0

    # Closing wakes a blocked getter with None and refuses further puts.
    get = queue.get_batch.remote(1, None)
    wait_until(lambda: ray.get(queue.waiting_getters.remote()) == 1, "the getter to block")
    ray.get(queue.close.remote())
    assert ray.get(get, timeout=WAIT_S) is None
    with pytest.raises(QueueClosed):
        ray.get(queue.put.remote(sample(0)))
    ray.kill(queue)


def test_spawn_queue_needs_room_for_a_getter_and_a_put() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        spawn_queue(max_concurrency=1)


def test_samples_outstanding_at_a_sync_count_against_the_next_allowance() -> None:
    admission = AdmissionControl(batch_size=4, sync_every=1, staleness=0.5)  # limit 6
    admitted = sum(admission.try_admit() for _ in range(10))
    assert admitted == 6
    admission.on_weight_sync(outstanding=2)  # 4 trained, 2 still queued or in flight
    assert sum(admission.try_admit() for _ in range(10)) == 4  # the backlog stays at 6
    with pytest.raises(ValueError, match="outstanding"):
        admission.on_weight_sync(outstanding=-1)


def as_scored(samples: Sequence[Sample]) -> list[ScoredSample]:
    return [ScoredSample(prompt="q", response=str(s.uid), row={}) for s in samples]


def test_samples_are_scored_as_they_arrive_each_once_and_taken_by_uid(ray_module: Any) -> None:
    """ScoresAhead fed by the queue (fully async with a reward service): the driver's
    thread has the service (rlhf_env's reward app, served here) score each sample as it
    reaches the queue, before any step takes it; a service that fails it leaves it NaN
    (unscored)."""
    ray = ray_module
    queue = spawn_queue(keep_arrivals=True)
    scored: list[str] = []
    requests: list[tuple[float, float]] = []

    def by_uid(prompt: str, response: str) -> float:
        scored.append(response)
        if response == "5":
            raise ValueError("no answer")
        return float(response)

    with served({"reward": reward_app_for(by_uid)}) as url:
        client = RewardClient(f"{url}/reward", retries=0, batch_size=2, concurrency=2)
        ahead = ScoresAhead(client, lambda *span: requests.append(span)).start()
        ahead.feed_from(QueueArrivals(queue, as_scored))
        for uid in range(4):
            ray.get(queue.put.remote(sample(uid)))
        wait_until(lambda: len(scored) == 4, "the samples scored before a step takes them")
        taken = ray.get(queue.get_batch.remote(4, WAIT_S))
        assert ahead.take([s.uid for s in taken[::-1]]).tolist() == [3.0, 2.0, 1.0, 0.0]
        ray.get(queue.put.remote(sample(4)))
        wait_until(lambda: "4" in scored, "sample 4 scored")  # a request of its own
        ray.get(queue.put.remote(sample(5)))
        rewards = ahead.take([4, 5])  # waits for 5's answer
        ahead.stop()
    assert rewards[0] == 4.0 and math.isnan(rewards[1])
    assert sorted(scored) == ["0", "1", "2", "3", "4", "5"]  # each once
    assert requests and all(start <= end for start, end in requests)
    ray.kill(queue)


def test_samples_offered_as_they_finish_are_scored_before_the_step_takes_them() -> None:
    """ScoresAhead fed by offers (the synchronous loop offers each sample as its engine
    yields it): each is scored when offered, and taken by key in the batch's order."""
    scored: list[str] = []

    def by_response(prompt: str, response: str) -> float:
        scored.append(response)
        return float(response)

    def offered(key: int) -> tuple[int, ScoredSample]:
        return key, ScoredSample(prompt="q", response=str(key), row={})

    with served({"reward": reward_app_for(by_response)}) as url:
        ahead = ScoresAhead(RewardClient(f"{url}/reward", retries=0), lambda *s: None).start()
        ahead.offer([offered(8)])
        ahead.offer([offered(7), offered(9)])
        wait_until(lambda: len(scored) == 3, "the offered samples scored before any take")
        assert ahead.take([9, 7, 8]).tolist() == [9.0, 7.0, 8.0]
        ahead.stop()
    assert sorted(scored) == ["7", "8", "9"]  # each once


def test_samples_offered_while_the_service_is_busy_wait_and_go_in_larger_requests() -> None:
    """At most `concurrency` requests in flight: what is offered meanwhile waits, and
    goes when a request ends, spread over the free ones and batchSize at most each."""
    sizes: list[int] = []
    first_held, release = threading.Event(), threading.Event()
    app = FastAPI()

    @app.post("/score")
    async def score(request: ScoreRequest) -> dict[str, Any]:
        sizes.append(len(request.samples))
        if len(sizes) == 1:
            first_held.set()
            await asyncio.to_thread(release.wait)
        return {"rewards": [float(s.response) for s in request.samples]}

    def offered(key: int) -> list[tuple[int, ScoredSample]]:
        return [(key, ScoredSample(prompt="q", response=str(key), row={}))]

    with served({"judge": app}) as url:
        client = RewardClient(f"{url}/judge", retries=0, concurrency=1, batch_size=3)
        ahead = ScoresAhead(client, lambda *span: None).start()
        ahead.offer(offered(0))
        assert first_held.wait(timeout=60)
        for key in range(1, 6):
            ahead.offer(offered(key))
        wait_until(lambda: len(ahead._waiting) == 5, "the offers queued behind the first")
        release.set()
        assert ahead.take([5, 4, 3, 2, 1, 0]).tolist() == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
        ahead.stop()
    assert sizes == [1, 3, 2]


def test_a_failure_to_score_ahead_is_the_steps(ray_module: Any) -> None:
    ray = ray_module
    queue = spawn_queue(keep_arrivals=True)

    def broken(samples: Sequence[Sample]) -> list[ScoredSample]:
        raise KeyError("prompt 7 is not in the data set")

    client = RewardClient("http://127.0.0.1:9", retries=0)
    ahead = ScoresAhead(client, lambda *span: None).start()
    ahead.feed_from(QueueArrivals(queue, broken))
    ray.get(queue.put.remote(sample(0)))
    with pytest.raises(RuntimeError, match="scoring the samples as they finish failed") as failed:
        ahead.take([0])
    assert isinstance(failed.value.__cause__, KeyError)
    ahead.stop()
    ray.kill(queue)
