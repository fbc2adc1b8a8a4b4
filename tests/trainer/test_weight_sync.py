"""Weight sync: the bucket plan, and real broadcasts between processes over gloo.

The multi-process tests spawn one sender and two receivers, as the actor's rank 0 and
two rollout engines would be, once without and once beside a default process group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.rollout import weight_sync
from rlhf_trainer.rollout.engine_weights import rollout_state_dict
from rlhf_trainer.rollout.weight_sync import (
    SyncGroup,
    WeightSpec,
    buffer_bound,
    plan_buckets,
    receive_weights,
    send_weights,
    weight_specs,
)
from rlhf_trainer.worker import free_port
from tests.trainer.sync_ranks import (
    TIMEOUT,
    WORLD_SIZE,
    RecordingLoader,
    spawn,
    sync_beside_default_group,
    sync_versions,
)

TINY = TinyModel(hidden_size=64, num_layers=2, num_heads=2, vocab_size=32)
BUCKET_BYTES = 20 * 1024  # small: the MLP matrices (64 KiB) are oversized, norms share
BF16_NAMES = ("model.layers.0.input_layernorm.weight", "model.layers.1.mlp.down_proj.weight")

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64


def spec(name: str, numel: int, dtype: torch.dtype = F32) -> WeightSpec:
    return WeightSpec(name, (numel,), dtype)


# --- the plan -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("specs", "bucket_bytes", "expected"),
    [
        # consecutive tensors fill a bucket up to the limit, exactly
        ([spec("a", 2), spec("b", 2), spec("c", 2)], 16, [["a", "b"], ["c"]]),
        ([spec("a", 1), spec("b", 1), spec("c", 1)], 100, [["a", "b", "c"]]),
        # a tensor larger than a bucket gets one of its own
        ([spec("a", 1), spec("big", 10), spec("b", 1)], 8, [["a"], ["big"], ["b"]]),
        ([spec("big", 10), spec("a", 1)], 8, [["big"], ["a"]]),
        # dtypes in order of first appearance, each in its own buckets, order kept
        (
            [spec("a", 1), spec("x", 1, BF16), spec("b", 1), spec("y", 1, BF16)],
            100,
            [["a", "b"], ["x", "y"]],
        ),
        ([spec("x", 4, BF16), spec("a", 1), spec("y", 4, BF16)], 8, [["x"], ["y"], ["a"]]),
        # empty tensors and no tensors
        ([spec("e", 0), spec("a", 2)], 8, [["e", "a"]]),
        ([], 8, []),
    ],
)
def test_plan_buckets_table(
    specs: list[WeightSpec], bucket_bytes: int, expected: list[list[str]]
) -> None:
    plan = plan_buckets(specs, bucket_bytes)
    assert [[s.name for s in bucket] for bucket in plan] == expected


dtypes = st.sampled_from([F32, BF16, I64, torch.uint8])
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
spec_lists = st.lists(st.tuples(shapes, dtypes), max_size=30).map(
    lambda items: [WeightSpec(f"w{i}", shape, dtype) for i, (shape, dtype) in enumerate(items)]
)


@given(spec_lists, st.integers(1, 400))
def test_plan_buckets_properties(specs: list[WeightSpec], bucket_bytes: int) -> None:
    plan = plan_buckets(specs, bucket_bytes)
    flat = [s for bucket in plan for s in bucket]
    # every tensor exactly once, in order within its dtype, dtypes by first appearance
    dtype_order = list(dict.fromkeys(s.dtype for s in specs))
    assert flat == sorted(specs, key=lambda s: dtype_order.index(s.dtype))  # stable sort
    for i, bucket in enumerate(plan):
        assert bucket, "no empty buckets"
        assert len({s.dtype for s in bucket}) == 1, "one dtype per bucket"
        size = weight_sync.bucket_nbytes(bucket)
        assert size <= bucket_bytes or len(bucket) == 1, "only a lone tensor may be oversized"
        assert size <= buffer_bound(specs, bucket_bytes)
        # greedy: the next tensor of the same dtype did not fit
        if i + 1 < len(plan) and plan[i + 1][0].dtype == bucket[0].dtype:
            assert size + plan[i + 1][0].nbytes > bucket_bytes


def test_plan_buckets_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([spec("a", 1)], 0)
    with pytest.raises(ValueError, match=r"repeated: \['a'\]"):
        plan_buckets([spec("a", 1), spec("b", 1), spec("a", 2)], 100)


def test_weight_spec_round_trips_through_json() -> None:
    specs = [WeightSpec("a.b", (3, 4), BF16), WeightSpec("c", (), I64), spec("d", 0)]
    assert [WeightSpec.from_json(s.to_json()) for s in specs] == specs
    assert specs[0].nbytes == 24 and specs[1].numel == 1
    with pytest.raises(ValueError, match="not a torch dtype"):
        WeightSpec.from_json({"name": "a", "shape": [1], "dtype": "Tensor"})


def policy_weights(version: int) -> dict[str, Tensor]:
    """The tiny qwen2's weights as the engine loads them (tied lm_head left out),
    two of them in bf16; each version differs from the last in every tensor."""
    weights = rollout_state_dict(build_tiny_model(TINY))
    for name in BF16_NAMES:
        weights[name] = weights[name].to(BF16)
    return {name: t * (version + 1) + version for name, t in weights.items()}


def test_the_test_weights_exercise_the_plan() -> None:
    specs = weight_specs(policy_weights(0))
    plan = plan_buckets(specs, BUCKET_BYTES)
    assert {s.dtype for s in specs} == {F32, BF16}
    assert any(len(b) == 1 and b[0].nbytes > BUCKET_BYTES for b in plan), "an oversized one"
    assert any(len(b) > 1 for b in plan), "a shared bucket"
    assert [b[0].dtype for b in plan].count(BF16) == 2, "bf16 buckets of their own"
    assert buffer_bound(specs, BUCKET_BYTES) < sum(s.nbytes for s in specs)


# --- real broadcasts --------------------------------------------------------------


@pytest.fixture(scope="module")
def two_versions() -> tuple[list[dict[str, Tensor]], list[dict[str, Any]]]:
    versions = [policy_weights(0), policy_weights(1)]
    specs = weight_specs(versions[0])
    return versions, spawn(sync_versions, versions, specs, BUCKET_BYTES)


def test_receivers_reconstruct_every_version_exactly(
    two_versions: tuple[list[dict[str, Tensor]], list[dict[str, Any]]],
) -> None:
    versions, results = two_versions
    for name in versions[0]:
        assert not torch.equal(versions[0][name], versions[1][name]), name
    assert not any(result["default_group"] for result in results)
    for rank in (1, 2):
        loaders: list[RecordingLoader] = results[rank]["loaders"]
        assert len(loaders) == len(versions)
        for sent, loader in zip(versions, loaders, strict=True):
            assert loader.weights.keys() == sent.keys()
            for name, tensor in sent.items():
                got = loader.weights[name]
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), (rank, name)


def test_load_is_called_once_per_bucket_with_its_names(
    two_versions: tuple[list[dict[str, Tensor]], list[dict[str, Any]]],
) -> None:
    versions, results = two_versions
    plan = [[s.name for s in b] for b in plan_buckets(weight_specs(versions[0]), BUCKET_BYTES)]
    for rank in (1, 2):
        for loader in results[rank]["loaders"]:
            assert loader.calls == plan
    for stats in (r["stats"] for r in results):
        assert [s.buckets for s in stats] == [len(plan)] * len(versions)


def test_each_side_holds_one_bucket_buffer(
    two_versions: tuple[list[dict[str, Tensor]], list[dict[str, Any]]],
) -> None:
    versions, results = two_versions
    specs = weight_specs(versions[0])
    bound = max(BUCKET_BYTES, max(s.nbytes for s in specs))
    largest = max(weight_sync.bucket_nbytes(b) for b in plan_buckets(specs, BUCKET_BYTES))
    assert largest <= bound == buffer_bound(specs, BUCKET_BYTES)
    for rank, result in enumerate(results):
        # one buffer per transfer, the size of the largest bucket
        assert result["allocations"] == [largest] * len(versions), rank
        assert [s.buffer_bytes for s in result["stats"]] == [largest] * len(versions)
    for rank in (1, 2):
        for loader in results[rank]["loaders"]:
            # every view handed to load lies in that one buffer
            assert len(loader.storages) == 1, rank
            assert next(iter(loader.storages))[1] == largest


def test_sync_beside_each_sides_default_group() -> None:
    weights = policy_weights(0)
    results = spawn(sync_beside_default_group, weights, weight_specs(weights), BUCKET_BYTES)
    for rank, result in enumerate(results):
        assert result["sync_rank_size"] == (rank, WORLD_SIZE)
        assert result["default_during"] == (0, 1)
        assert result["default_after"] == (0, 1, rank + 1.0)
        assert result["same_default"] and result["groups_unchanged"], rank
        assert "disagree on the weight specs" in result["mismatch"], rank
        if rank:
            for key in ("weights", "again"):
                assert result[key].keys() == weights.keys()
                for name, tensor in weights.items():
                    assert torch.equal(result[key][name], tensor), (rank, key, name)


def test_only_the_sender_sends() -> None:
    port = free_port()
    with SyncGroup.create("127.0.0.1", port, 0, 1, timeout=TIMEOUT) as group:
        assert group.is_sender
        with pytest.raises(ValueError, match="only a receiver"):
            receive_weights(group, [], BUCKET_BYTES, RecordingLoader())
        stats = send_weights(group, {"a": torch.ones(3)}, BUCKET_BYTES)  # nobody listens
        assert (stats.tensors, stats.buckets, stats.bytes) == (1, 1, 12)
    with pytest.raises(ValueError, match="rank 3 is not in a group of 2"):
        SyncGroup.create("127.0.0.1", port, 3, 2)


def test_an_engine_beside_the_actor_syncs_through_host_memory() -> None:
    assert weight_sync.sync_device("host") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert weight_sync.sync_device("accelerator").type == expected
    with pytest.raises(ValueError, match="'host' or 'accelerator', not 'nccl'"):
        weight_sync.sync_device("nccl")
