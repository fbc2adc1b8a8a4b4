"""trainer.precision and trainer.gradientCheckpointing on real gloo ranks: bf16 computes
in bf16 around fp32 master weights and gradients; checkpointing recomputes activations
and changes no gradient. The engines and the ref follow the precision."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.roles.trainable import prepare_trainable
from rlhf_trainer.rollout.engine import EngineOptions
from tests.specs import local_job
from tests.trainer.distributed import run_ranks
from tests.trainer.tiny_training import Kind, build, global_batch, loss


def config(precision: str = "fp32", checkpointing: bool = False) -> JobConfig:
    spec = local_job(colocated=True, total_steps=1, checkpoint_dir=Path("/tmp/x"), every_steps=1)
    trainer = spec.trainer.model_copy(
        update={"precision": precision, "gradient_checkpointing": checkpointing}
    )
    return spec.model_copy(update={"trainer": trainer})


@dataclass
class Step:
    loss: float
    output_dtype: torch.dtype
    master_dtypes: set[torch.dtype]
    grad_dtypes: set[torch.dtype]
    grads: dict[str, torch.Tensor]
    checkpointing: bool


def one_step(rank: int, kind: Kind, precision: str, checkpointing: bool) -> Step:
    def load(weights: bool) -> torch.nn.Module:
        return build(kind)  # the same tiny model, with or without weights

    model = prepare_trainable(load, config(precision, checkpointing), torch.device("cpu"))
    batch = global_batch(0)
    if kind == "actor":
        output_dtype = model(input_ids=batch["input_ids"]).logits.dtype
    else:
        output_dtype = model(batch["input_ids"], batch["attention_mask"]).dtype
    value = loss(kind, model, batch)
    value.backward()  # type: ignore[no-untyped-call]
    transformer = model if kind == "actor" else model.backbone
    return Step(
        loss=float(value),
        output_dtype=output_dtype,
        master_dtypes={p.dtype for p in model.parameters()},
        grad_dtypes={p.grad.dtype for p in model.parameters() if p.grad is not None},
        grads={n: p.grad.full_tensor().clone() for n, p in model.named_parameters()},
        checkpointing=transformer.is_gradient_checkpointing,
    )


def both_roles(rank: int, precision: str, checkpointing: bool) -> dict[str, Step]:
    return {kind: one_step(rank, kind, precision, checkpointing) for kind in ("actor", "critic")}


@pytest.fixture(scope="module")
def steps() -> dict[tuple[str, bool], dict[str, Step]]:
    """(precision, checkpointing) -> each trained role's step; one rank each (a spawn
    costs seconds)."""
    settings = [("fp32", False), ("bf16", False), ("fp32", True)]
    return {s: run_ranks(both_roles, 1, *s)[0] for s in settings}


def test_bf16_computes_in_bf16_around_fp32_masters_and_gradients(
    steps: dict[tuple[str, bool], dict[str, Step]],
) -> None:
    for kind in ("actor", "critic"):
        fp32, bf16 = steps["fp32", False][kind], steps["bf16", False][kind]
        assert fp32.output_dtype == torch.float32
        assert bf16.output_dtype == torch.bfloat16, kind
        assert bf16.master_dtypes == bf16.grad_dtypes == {torch.float32}, kind
        # The same step, to bf16's precision (8 bits of mantissa).
        assert abs(bf16.loss - fp32.loss) <= 2e-2 * abs(fp32.loss), (kind, bf16.loss, fp32.loss)


def test_gradient_checkpointing_recomputes_and_changes_no_gradient(
    steps: dict[tuple[str, bool], dict[str, Step]],
) -> None:
    for kind in ("actor", "critic"):
        plain, recomputed = steps["fp32", False][kind], steps["fp32", True][kind]
        assert recomputed.checkpointing and not plain.checkpointing
        assert recomputed.loss == plain.loss
        for name, grad in plain.grads.items():
            torch.testing.assert_close(recomputed.grads[name], grad, rtol=1e-5, atol=1e-7)


def test_the_engines_run_in_the_precision_the_trainer_computes_in() -> None:
    assert EngineOptions.of(config("bf16")).dtype == "bfloat16"
    assert EngineOptions.of(config("fp32")).dtype == "float32"
