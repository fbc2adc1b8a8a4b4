"""trainer.precision and trainer.gradientCheckpointing on real gloo ranks: bf16 computes
in bf16 around fp32 master weights and gradients; checkpointing recomputes activations
and changes no gradient. The engines and the ref follow the precision. And a few steps
of the whole loop in bf16, as on GPUs: the ref in bf16, the actor's mixed-precision
update, the weight sync cast to bf16 and the engine in bf16."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.roles.policy import Ref
from rlhf_trainer.roles.trainable import prepare_trainable
from rlhf_trainer.rollout.engine import EngineOptions
from rlhf_trainer.worker import RankInfo
from tests.specs import local_job
from tests.trainer.distributed import run_ranks
from tests.trainer.local_runs import Trained, push_skipped, train
from tests.trainer.tiny_training import Kind, build, global_batch, loss

# vLLM's bf16 kernels against the actor's bf16 compute: bf16 keeps 8 bits of mantissa,
# so a log-prob of a few nats is off by up to ~1e-2 (the engine test measured 1.1e-2).
BF16_LOG_PROB_TOLERANCE = 0.05
BF16_START_KL = 1e-2
BF16_STEPS = 3
STALE_STEP = 3  # samples with step 1's weights: the push after step 2 is skipped


def config(
    precision: str = "fp32",
    checkpointing: bool = False,
    total_steps: int = 1,
    checkpoint_dir: Path = Path("/tmp/x"),
) -> JobConfig:
    spec = local_job(
        colocated=True, total_steps=total_steps, checkpoint_dir=checkpoint_dir, every_steps=100
    )
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


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    with push_skipped(STALE_STEP - 1):
        return train(
            config("bf16", total_steps=BF16_STEPS, checkpoint_dir=tmp_path_factory.mktemp("bf16"))
        )


def test_the_ref_loads_in_bf16() -> None:
    ref = Ref(RankInfo(Role.REF, "policy", 0, 1), config("bf16"))
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}


def test_a_bf16_run_samples_with_the_actors_weights_within_bf16s_precision(
    bf16_run: Trained,
) -> None:
    """The engine's bf16 log-probs of each batch against the actor's bf16 compute of its
    fp32 masters, after every push, within BF16_LOG_PROB_TOLERANCE; step 3 samples with
    stale weights (its push skipped) and must fail that check."""
    steps = bf16_run.steps
    assert [s.step for s in steps] == list(range(1, BF16_STEPS + 1))
    diffs = {s.step: s.rollout_log_prob_diff for s in steps}
    print("max |log π_actor - log π_vllm| per step, bf16:", diffs)
    assert max(d for step, d in diffs.items() if step != STALE_STEP) < BF16_LOG_PROB_TOLERANCE
    assert diffs[STALE_STEP] > 2 * BF16_LOG_PROB_TOLERANCE, diffs
    # Step 1 samples from the start, which the ref holds in bf16 and the actor computes
    # with in bf16: their KL is bf16's rounding alone (measured 1.4e-3; 0 in fp32).
    assert abs(steps[0].kl) < BF16_START_KL, steps[0].kl
    for step in steps:
        assert step.critic is not None
        assert math.isfinite(step.actor.policy_loss) and math.isfinite(step.critic.value_loss)
