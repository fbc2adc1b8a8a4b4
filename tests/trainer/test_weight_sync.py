"""The host weight transfer (CPU): the bucket plan, shared-memory segments, and real
transfers between processes through vLLM's trainer-side API, to an engine on the
sender's node (shared memory) and one on another (gloo).

The vLLM side of the same backend (loading into a running engine, its version) is
tested with real engines in test_rollout_vllm.py and test_rollout_async.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.rollout import transfer_memory
from rlhf_trainer.rollout.engine_weights import rollout_state_dict
from rlhf_trainer.rollout.transfer_memory import RING_SLOTS, PackedWeights, Segment
from rlhf_trainer.rollout.weight_sync import (
    ALIGN,
    Bucket,
    TransferError,
    WeightSpec,
    bucket_views,
    pack_bucket,
    plan_buckets,
    slot_bytes,
    weight_specs,
)
from tests.trainer.sync_ranks import ENGINES, REMOTE, TINY, send_versions, spawn

BUCKET_BYTES = 40 * 1024  # small: a decoder layer (~66 KiB in bf16) is a bucket of its own

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64


def spec(name: str, numel: int, dtype: torch.dtype = F32) -> WeightSpec:
    return WeightSpec(name, (numel,), dtype)


def names(plan: list[Bucket]) -> list[list[str]]:
    return [bucket.names for bucket in plan]


# --- the plan -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("specs", "layers", "bucket_bytes", "expected"),
    [
        # whole layers fill a bucket up to the limit
        (
            [spec("a", 2), spec("b", 2), spec("c", 2)],
            [["a"], ["b"], ["c"]],
            72,
            [["a", "b"], ["c"]],
        ),
        # a layer is never split, even past the limit: it gets a bucket of its own
        (
            [spec("a", 1), spec("b", 10), spec("c", 10)],
            [["a"], ["b", "c"]],
            16,
            [["a"], ["b", "c"]],
        ),
        # layers in the layers' order, and dtypes mix within a bucket
        ([spec("x", 1, BF16), spec("a", 1)], [["a"], ["x"]], 1000, [["a", "x"]]),
        # empty tensors and no tensors
        ([spec("e", 0), spec("a", 2)], [["e", "a"]], 8, [["e", "a"]]),
        ([], [], 8, []),
    ],
)
def test_plan_buckets_table(
    specs: list[WeightSpec], layers: list[list[str]], bucket_bytes: int, expected: list[list[str]]
) -> None:
    assert names(plan_buckets(specs, bucket_bytes, layers)) == expected


dtypes = st.sampled_from([F32, BF16, I64, torch.uint8])
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
spec_lists = st.lists(st.tuples(shapes, dtypes), max_size=30).map(
    lambda items: [WeightSpec(f"w{i}", shape, dtype) for i, (shape, dtype) in enumerate(items)]
)


@given(spec_lists, st.integers(1, 400), st.integers(1, 4))
def test_plan_buckets_properties(specs: list[WeightSpec], bucket_bytes: int, width: int) -> None:
    layers = [[s.name for s in specs[i : i + width]] for i in range(0, len(specs), width)]
    plan = plan_buckets(specs, bucket_bytes, layers)
    # every tensor once, in the layers' order, and no layer split over two buckets
    assert [n for bucket in plan for n in bucket.names] == [n for layer in layers for n in layer]
    for layer in layers:
        assert sum(any(n in b.names for n in layer) for b in plan) <= 1
    stored_at = 0
    for bucket in plan:
        assert bucket.names, "no empty buckets"
        assert (
            bucket.stored_at == stored_at
            and bucket.model_bytes == plan[-1].stored_at + plan[-1].nbytes
        )
        stored_at += bucket.nbytes
        ends = [o + s.nbytes for o, s in zip(bucket.offsets, bucket.specs(), strict=True)]
        assert all(o % ALIGN == 0 for o in bucket.offsets)
        assert all(e <= o for e, o in zip(ends, bucket.offsets[1:], strict=False)), "no overlap"
        assert bucket.nbytes == ends[-1]
        lone_layer = any(set(bucket.names) == set(layer) for layer in layers)
        assert bucket.nbytes <= bucket_bytes or lone_layer
    assert slot_bytes(plan) == max((b.nbytes for b in plan), default=0)


def test_plan_buckets_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([spec("a", 1)], 0, [["a"]])
    with pytest.raises(ValueError, match=r"repeated: \['a'\]"):
        plan_buckets([spec("a", 1), spec("b", 1), spec("a", 2)], 100, [["a", "b"]])
    with pytest.raises(ValueError, match="every weight exactly once"):
        plan_buckets([spec("a", 1), spec("b", 1)], 100, [["a"]])


def test_a_bucket_travels_as_a_dict_and_packs_its_tensors() -> None:
    weights = {"a": torch.arange(3.0), "b": torch.ones(2, 2, dtype=BF16), "c": torch.tensor(7)}
    specs = weight_specs(weights)
    (bucket,) = plan_buckets(specs, 1000, [list(weights)])
    assert Bucket.from_dict(bucket.to_dict()) == bucket
    with pytest.raises(TransferError, match="not a weight bucket"):
        Bucket.from_dict({"names": []})
    memory = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(memory, bucket, {n: t.float() for n, t in weights.items()})  # casts back
    for (name, view), expected in zip(bucket_views(memory, bucket), weights.values(), strict=True):
        assert view.dtype == expected.dtype and torch.equal(view, expected), name


# --- shared memory ----------------------------------------------------------------


def test_a_segment_is_shared_and_removed_by_its_owner() -> None:
    segment = Segment.create("rlhf-test", 128)
    other = Segment.attach(segment.name)
    segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert other.tensor[:4].tolist() == [1, 2, 3, 4]  # the same memory
    other.close()
    assert (transfer_memory.SHM_DIR / segment.name).exists(), "an attached one leaves the file"
    segment.close()
    assert not (transfer_memory.SHM_DIR / segment.name).exists()
    with pytest.raises(TransferError, match="no shared-memory segment"):
        Segment.attach(segment.name)


def test_a_segment_that_cannot_be_made_names_its_size_and_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(transfer_memory, "SHM_DIR", tmp_path / "missing")
    with pytest.raises(TransferError, match=r"segment of 2\.0 MiB .*No such file"):
        Segment.create("rlhf-test", 2 * 2**20)


def test_segments_of_processes_killed_outright_are_removed_by_the_next_create(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(transfer_memory, "SHM_DIR", tmp_path)
    exited = subprocess.Popen(["true"])
    exited.wait()
    orphan = tmp_path / f"rlhf-weights-{exited.pid}-0123456789ab"
    orphan.write_bytes(b"left behind")
    alive = Segment.create("rlhf-test", 16)  # by this live process
    again = Segment.create("rlhf-test", 16)
    assert not orphan.exists() and (tmp_path / alive.name).exists()
    assert (tmp_path / again.name).exists(), "a live process's segments stay"
    alive.close()
    again.close()


def test_packed_weights_hold_every_weight_in_its_bucket() -> None:
    weights = rollout_state_dict(build_tiny_model(TINY))
    packed = PackedWeights("rlhf-test-packed", weights, [[name] for name in weights])
    memory = packed.segment.tensor
    seen = [
        name
        for bucket in packed.buckets
        for name, view in bucket_views(memory[bucket.offset :], bucket)
        if torch.equal(view, weights[name])
    ]
    assert seen == list(weights)
    path = transfer_memory.SHM_DIR / packed.segment.name
    packed.close()
    assert not path.exists()


# --- real transfers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def two_pushes() -> list[dict[str, Any]]:
    return spawn(send_versions, [1.0, -2.0], BUCKET_BYTES)


def test_every_engine_loads_every_version_exactly_with_its_number(
    two_pushes: list[dict[str, Any]],
) -> None:
    sender, *engines = two_pushes
    first, second = sender["sent"]
    assert all(t.dtype == BF16 for t in first.values()), "sent in the engines' dtype"
    assert "lm_head.weight" not in first, "the tied head stays behind"
    assert not any(torch.equal(first[n], second[n]) for n in first if first[n].any())
    for index, engine in enumerate(engines):
        assert engine["versions"] == [1, 2], index
        for sent, loaded in zip(sender["sent"], engine["loads"], strict=True):
            assert loaded.keys() == sent.keys()
            for name, tensor in sent.items():
                got = loaded[name]
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), (index, name)


def test_buckets_are_whole_layers_and_the_ring_is_two_of_them(
    two_pushes: list[dict[str, Any]],
) -> None:
    sender, *engines = two_pushes
    plan = sender["plan"]
    assert 3 < len(plan) < 10, plan  # decoder layers apart; embeddings, norm
    for layer in range(TINY.num_layers):
        holding = [b for b in plan if any(f"layers.{layer}." in n for n in b)]
        assert len(holding) == 1, (layer, holding)
    for engine in engines:
        assert engine["buckets"] == [plan, plan]
    assert sender["ring_bytes"] % RING_SLOTS == 0
    assert sender["ring_bytes"] // RING_SLOTS < sum(t.nbytes for t in sender["sent"][0].values())


def test_an_engine_beside_the_sender_reads_its_ring_and_one_elsewhere_its_own(
    two_pushes: list[dict[str, Any]],
) -> None:
    sender, *engines = two_pushes
    for index, engine in enumerate(engines):
        if index in REMOTE:
            assert engine["segments"] == {engine["relay_ring"]} != {sender["ring"]}
        else:
            assert engine["segments"] == {sender["ring"]} and engine["relay_ring"] is None
    assert len(engines) == ENGINES
    leftovers = [p.name for p in transfer_memory.SHM_DIR.glob("rlhf-weights-*")]
    assert sender["ring"] not in leftovers, "the sender removes its ring"


def test_an_fp32_policy_reaches_engines_on_the_senders_node_exactly() -> None:
    """The actor's dtype (no cast), every engine on the sender's node: each tensor goes
    through the sender's ring, and every engine loads each push exactly as sent."""
    sender, *engines = spawn(send_versions, [1.0, -2.0], BUCKET_BYTES, torch.float32, ())
    assert sender["ring_written"]
    for engine in engines:
        assert engine["versions"] == [1, 2]
        assert engine["segments"] == {sender["ring"]}
        for sent, loaded in zip(sender["sent"], engine["loads"], strict=True):
            assert all(torch.equal(loaded[name], tensor) for name, tensor in sent.items())
