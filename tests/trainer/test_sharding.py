"""FSDP2 sharding of the actor and critic on real gloo ranks, against one plain process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from rlhf_trainer.api.sections import ModelSource
from rlhf_trainer.models import build_tiny_model, write_tiny_model
from rlhf_trainer.roles.sharding import decoder_layers, full_state_dict, shard_model
from rlhf_trainer.roles.trainable import load_policy, load_value_model, prepare_trainable
from tests.specs import job_config
from tests.trainer.distributed import run_ranks
from tests.trainer.tiny_training import (
    MAX_GRAD_NORM,
    TINY,
    Kind,
    assert_state_dicts_close,
    build,
    global_batch,
    optimizer,
    rank_batch,
    train_step,
)

STEPS = 3
# Sharded and plain runs add the same numbers in a different order (reduce-scatter vs
# one backward): float32 noise. Adam scales each element's step by its own gradient
# history, so where the true gradient is about zero the noise alone takes steps; the key
# projection's bias is such a weight (softmax ignores a shift of every score), seen
# ~1e-5 apart. A wrong gradient is off by whole steps: LEARNING_RATE = 1e-2.
WEIGHT_TOLERANCE = 1e-4
NORM_TOLERANCE = 1e-5  # relative


@dataclass
class TrainingRun:
    initial: dict[str, Tensor]  # the full state dict right after sharding
    trained: dict[str, Tensor]  # ... after STEPS steps
    grad_norms: list[float]
    tied: bool  # the LM head is still the embeddings' parameter


def train_sharded(rank: int, kind: Kind, world_size: int) -> TrainingRun:
    model = shard_model(build(kind))
    initial = full_state_dict(model)
    opt = optimizer(model)
    norms = [train_step(kind, model, opt, rank_batch(s, rank, world_size)) for s in range(STEPS)]
    embeddings = model.get_input_embeddings() if kind == "actor" else None
    tied = embeddings is not None and model.get_output_embeddings().weight is embeddings.weight
    return TrainingRun(initial, full_state_dict(model), norms, tied)


def train_plain(kind: Kind) -> TrainingRun:
    model = build(kind)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = optimizer(model)
    norms = [train_step(kind, model, opt, global_batch(s)) for s in range(STEPS)]
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TrainingRun(initial, trained, norms, tied=kind == "actor")


@pytest.fixture(scope="module")
def actor_runs() -> tuple[list[TrainingRun], TrainingRun]:
    return run_ranks(train_sharded, 2, "actor", 2), train_plain("actor")


def test_two_ranks_train_like_one_process_on_the_whole_batch(
    actor_runs: tuple[list[TrainingRun], TrainingRun],
) -> None:
    (rank0, rank1), plain = actor_runs
    # Adam's steps do not see the gradients' scale; the norms do (a sum over ranks
    # instead of a mean would double them), the weights check the directions.
    assert rank0.grad_norms == rank1.grad_norms
    assert rank0.grad_norms == pytest.approx(plain.grad_norms, rel=NORM_TOLERANCE)
    assert min(plain.grad_norms) > MAX_GRAD_NORM  # so clipping was active in every step
    assert_state_dicts_close(rank0.trained, plain.trained, atol=WEIGHT_TOLERANCE)
    moved = max((plain.trained[k] - plain.initial[k]).abs().max() for k in plain.initial)
    assert moved > 100 * WEIGHT_TOLERANCE  # the steps changed the weights beyond the tolerance


def test_one_rank_takes_the_same_path_and_its_full_state_dict_is_a_snapshot() -> None:
    (run,) = run_ranks(train_sharded, 1, "actor", 1)
    plain = train_plain("actor")
    # Taken before the steps: a view of the live weights would have moved with them.
    assert_state_dicts_close(run.initial, plain.initial, atol=0)
    assert_state_dicts_close(run.trained, plain.trained, atol=WEIGHT_TOLERANCE)
    assert run.tied


def test_full_state_dict_is_the_plain_model_on_rank_0_only(
    actor_runs: tuple[list[TrainingRun], TrainingRun],
) -> None:
    (rank0, rank1), plain = actor_runs
    assert rank1.initial == {} and rank1.trained == {}
    assert rank0.initial.keys() == plain.initial.keys()  # Hugging Face names, no FSDP prefix
    for name, tensor in plain.initial.items():
        assert rank0.initial[name].device.type == "cpu"
        assert torch.equal(rank0.initial[name], tensor), name
    fresh = build_tiny_model(TINY, seed=1)
    fresh.load_state_dict(rank0.trained, strict=True)
    assert torch.equal(fresh.model.norm.weight, rank0.trained["model.norm.weight"])


def test_the_tied_lm_head_stays_the_embeddings_through_sharding_and_steps(
    actor_runs: tuple[list[TrainingRun], TrainingRun],
) -> None:
    (rank0, rank1), _ = actor_runs
    assert rank0.tied and rank1.tied
    head, embeddings = rank0.trained["lm_head.weight"], rank0.trained["model.embed_tokens.weight"]
    assert torch.equal(head, embeddings)
    assert not torch.equal(embeddings, rank0.initial["model.embed_tokens.weight"])


def test_the_value_model_shards_and_trains_like_one_process() -> None:
    rank0, _ = run_ranks(train_sharded, 2, "critic", 2)
    plain = train_plain("critic")
    assert rank0.grad_norms == pytest.approx(plain.grad_norms, rel=NORM_TOLERANCE)
    assert_state_dicts_close(rank0.trained, plain.trained, atol=WEIGHT_TOLERANCE)
    assert "backbone.layers.1.mlp.up_proj.weight" in rank0.trained
    assert not torch.equal(rank0.trained["value_head.weight"], plain.initial["value_head.weight"])


def test_decoder_layers_are_found_in_a_causal_lm_and_a_value_model() -> None:
    for kind in ("actor", "critic"):
        layers = decoder_layers(build(kind))
        assert [type(layer).__name__ for layer in layers] == ["Qwen2DecoderLayer"] * 2
    with pytest.raises(ValueError, match="no decoder layers"):
        shard_model(torch.nn.Linear(2, 2))


@dataclass
class LoadedRank:
    loads: list[bool]  # the `weights` argument of each load call on this rank
    state: dict[str, Tensor]  # full_state_dict after loading ({} off rank 0)
    buffers: dict[str, Tensor]  # this rank's, whole
    logits: Tensor  # of a fixed batch


def load_on_ranks(rank: int, kind: Kind, directory: str) -> LoadedRank:
    source = ModelSource(path=directory)
    loads: list[bool] = []

    def load(weights: bool) -> torch.nn.Module:
        loads.append(weights)
        if kind == "critic":
            return load_value_model(source, seed=0, weights=weights)
        return load_policy(source, seed=0, weights=weights)

    roles = {role: "p" for role in ("actor", "rollout", "ref", "critic", "reward")}
    config = job_config([{"name": "p", "replicas": 1, "gpusPerNode": 2}], roles)
    model = prepare_trainable(load, config, torch.device("cpu"))
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    return LoadedRank(loads, full_state_dict(model), buffers, forward(kind, model))


def forward(kind: Kind, model: torch.nn.Module) -> Tensor:
    batch = global_batch(0)
    with torch.no_grad():
        if kind == "critic":
            return model(batch["input_ids"], batch["attention_mask"])
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_only_rank_0_loads_the_weights_and_every_shard_gets_them(
    kind: Kind, tmp_path: Path
) -> None:
    """Rank 1 builds the model on the meta device and receives its shard from rank 0:
    the sharded model computes what the checkpoint loaded in one process computes,
    buffers outside the state dict (the rotary inv_freq) included."""
    directory = str(write_tiny_model(TINY, tmp_path, seed=3))
    rank0, rank1 = run_ranks(load_on_ranks, 2, kind, directory)
    assert rank0.loads == [True, False] and rank1.loads == [False]
    source = ModelSource(path=directory)
    plain = load_value_model(source, 0) if kind == "critic" else load_policy(source, 0)
    assert_state_dicts_close(rank0.state, plain.state_dict(), atol=0)
    for rank in (rank0, rank1):
        assert rank.buffers.keys() == dict(plain.named_buffers()).keys()
        for name, buffer in plain.named_buffers():
            assert torch.equal(rank.buffers[name], buffer), name
        assert torch.allclose(rank.logits, forward(kind, plain), atol=1e-5)
