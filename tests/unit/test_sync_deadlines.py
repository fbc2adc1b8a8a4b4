"""The deadlines of a weight sync's phases (`rollout.sync_deadlines`): sized from the
bytes and a measured rate, with a floor (checked against a naive search), and a missed
one as the driver sees it (`loop.weights`): engines to replace, named with the phase and
the bytes. No Ray, no clock: the clock's times are given."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlhf_trainer.api.sections import TrainerConfig
from rlhf_trainer.cluster.engine_client import phase_ceiling_s
from rlhf_trainer.loop.weights import EnginesStalled, SyncFailure, WeightSync
from rlhf_trainer.rollout.push_verdict import PushFailed
from rlhf_trainer.rollout.sync_deadlines import (
    ASSUMED_BYTES_PER_S,
    PHASE_FLOOR_S,
    SLACK,
    Stall,
    SyncClock,
    call_bytes,
    measured_rate,
    phase_deadline_s,
)
from rlhf_trainer.worker import RENDEZVOUS_TIMEOUT

MB = 10**6


def naive_deadline_s(nbytes: int, bytes_per_s: int, floor_s: int, ceiling_s: int) -> float:
    """The first whole millisecond from the floor at which, at the rate, SLACK times the
    bytes would have moved; the ceiling if none before it."""
    t_ms = floor_s * 1000
    while t_ms < ceiling_s * 1000 and t_ms * bytes_per_s < SLACK * nbytes * 1000:
        t_ms += 1
    return t_ms / 1000


@given(
    nbytes=st.integers(0, 200 * MB),
    bytes_per_s=st.integers(1 * MB, 50 * MB),
    floor_s=st.integers(0, 10),
    extra_s=st.integers(0, 20),
)
def test_a_phase_deadline_is_the_naive_searchs(
    nbytes: int, bytes_per_s: int, floor_s: int, extra_s: int
) -> None:
    ceiling_s = floor_s + extra_s
    sized = phase_deadline_s(nbytes, bytes_per_s, floor_s, ceiling_s)
    assert sized == pytest.approx(naive_deadline_s(nbytes, bytes_per_s, floor_s, ceiling_s),
                                  abs=1e-3)  # fmt: skip
    assert floor_s <= sized <= ceiling_s


def test_the_floor_holds_for_a_phase_that_moves_nothing_and_the_ceiling_caps_a_big_one() -> None:
    assert phase_deadline_s(0, 1.0, floor_s=30, ceiling_s=60) == 30
    assert phase_deadline_s(10**12, 1.0, floor_s=30, ceiling_s=60) == 60
    assert phase_deadline_s(10 * MB, 1 * MB, floor_s=30, ceiling_s=60) == 40  # SLACK 4 x 10 s
    with pytest.raises(ValueError):
        phase_deadline_s(1, 0.0, 1, 2)


def test_the_rate_is_the_bytes_over_the_seconds_with_the_assumed_rate_as_a_prior() -> None:
    assert measured_rate([]) == ASSUMED_BYTES_PER_S
    # Bytes over seconds (not a mean of rates): 1 s at 100 MB/s and 9 s at 10 MB/s.
    samples = [(100.0 * MB, 1.0), (90.0 * MB, 9.0)]
    assert measured_rate(samples, assumed=50 * MB, prior_s=2.0) == (290 * MB) / 12.0
    # Measurement outweighs the prior once it is long.
    assert measured_rate([(10.0 * MB, 1.0)] * 1000) == pytest.approx(10 * MB, rel=0.01)


def test_the_bytes_of_an_update_come_from_our_bucket_or_vllms_names_dtypes_and_shapes() -> None:
    assert call_bytes("update_weights", ({"nbytes": 4096, "model_bytes": 10**6},)) == 4096
    vllm_update = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"],
                   "shapes": [[3, 4], [5]]}  # fmt: skip
    assert call_bytes("update_weights", (vllm_update,)) == 3 * 4 * 2 + 5 * 4
    assert call_bytes("start_weight_update", ()) == 0


def test_a_phase_that_moves_little_waits_the_floor_not_the_jobs_timeout() -> None:
    """The job's timeout is the ceiling: a stalled start is seen after PHASE_FLOOR_S,
    not 600 s; a timeout under the floor is the floor too."""
    assert SyncClock(ceiling_s=600).deadline_s("start_weight_update", 0) == PHASE_FLOOR_S
    assert SyncClock(ceiling_s=5).deadline_s("start_weight_update", 0) == 5
    huge = 10**15  # a whole model in one NCCL update, at the assumed rate: the ceiling
    assert SyncClock(ceiling_s=600).deadline_s("update_weights", huge) == 600


def test_no_phase_outlasts_the_actor_ranks_wait_for_rank_0_in_a_gather() -> None:
    """Past their process group's timeout the actor's other ranks would fail (the actor
    lost) before rank 0 named the stalled engine: the ceiling is a minute under it."""
    group_wait_s = RENDEZVOUS_TIMEOUT.total_seconds()
    timeout_s = TrainerConfig.model_fields["weight_sync_timeout_seconds"].default
    assert phase_ceiling_s(timeout_s) == min(timeout_s, group_wait_s - 60)
    assert phase_ceiling_s(86_400) == group_wait_s - 60
    assert phase_ceiling_s(30) == 30


def test_the_clock_sizes_buckets_by_their_bytes_and_the_finish_by_the_push() -> None:
    clock = SyncClock(ceiling_s=1000, floor_s=10)
    bucket = {"nbytes": 400 * MB, "model_bytes": 800 * MB}
    assert clock.sent("start_weight_update", (), push_bytes=0) == 0
    assert clock.deadline_s("start_weight_update", 0) == 10  # the floor
    nbytes = clock.sent("update_weights", (bucket,), push_bytes=0)
    assert clock.total == 800 * MB
    assert clock.deadline_s("update_weights", nbytes) == SLACK * 4  # at the assumed 100 MB/s
    clock.answered("update_weights", nbytes, began=0.0, now=39.0)  # 400 MB in 39 s
    assert measured_rate(clock.samples) == 500 * MB / 40
    # A call sent before that answer begins with it: calls are answered in order.
    assert clock.begins(sent_at=20.0) == 39.0 and clock.begins(sent_at=50.0) == 50.0
    assert clock.deadline_s("update_weights", nbytes) == SLACK * 400 / 12.5
    assert clock.deadline_s("finish_weight_update", 0) == SLACK * 800 / 12.5
    stall = clock.stall("gen", [1], "update_weights")
    assert stall == Stall("gen", (1,), "bucket", 400 * MB, 800 * MB)


def a_verdict(stall: Stall) -> PushFailed:
    """A push that missed a deadline as every actor rank raises it (push_verdict)."""
    return PushFailed(
        "the weight push of version 4 failed: actor rank 0: weight transfer, update_weights "
        f"on every engine: {stall} (its deadline 20 s, for 64 bytes). no answer within 20 s"
    )


def test_a_stall_is_read_back_from_any_error_that_carries_its_text() -> None:
    stall = Stall("gen-pool", (1, 3), "bucket", 64, 256)
    assert Stall.found_in(a_verdict(stall)) == stall
    assert Stall.found_in(RuntimeError(f"could not start: {stall}")) == stall
    assert Stall.found_in(RuntimeError("rollout rank 1 on pool gen died")) is None


def test_the_driver_raises_a_missed_deadline_as_engines_stalled_and_records_the_phase() -> None:
    stall = Stall("gen", (1,), "bucket", 64, 256)
    sync = WeightSync(groups=None, timeout_s=10)  # type: ignore[arg-type]  # not called
    with pytest.raises(EnginesStalled) as raised, sync.failing():
        raise a_verdict(stall)
    error = raised.value
    assert (error.role, error.pool, error.ranks) == ("rollout", "gen", (1,))
    assert str(error) == (
        "rollout rank(s) 1 on pool gen missed the bucket deadline of a weight sync with 64 "
        "of 256 bytes moved: replaced as lost"
    )
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # it crosses Ray
    with pytest.raises(RuntimeError), sync.failing():  # another failure, as it is
        raise RuntimeError("weight transfer, finish_weight_update: rollout rank 0 failed")
    assert sync.take_failures() == [
        SyncFailure("bucket", str(stall)),
        SyncFailure("finish", "a weight sync failed in its finish phase (RuntimeError)"),
    ]
    assert sync.take_failures() == []
