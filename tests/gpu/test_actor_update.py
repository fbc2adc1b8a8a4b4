"""The actor's update on CUDA, as a GPU pool runs it: FSDP2 over NCCL, bf16 compute
around fp32 master weights (trainer.precision: bf16), against the same update in fp32.

On CPUs the same code runs over gloo (tests/trainer/test_precision.py); here NCCL, CUDA's
bf16 kernels and FSDP2's casts on a GPU are what is tested."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rlhf_trainer.algo.experience import Experience
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.roles.policy import Actor
from rlhf_trainer.worker import RankInfo
from tests.gpu.machine import needs
from tests.specs import local_job
from tests.trainer.distributed import run_ranks

pytestmark = needs(gpus=1)

ROWS, LENGTH, RESPONSE = 16, 48, 32
# bf16 keeps 8 bits of mantissa: its log-probs of a few nats are off by up to ~1e-2.
BF16_LOG_PROB_TOLERANCE = 0.05
# After one update, the masters differ too (Adam on bf16's gradients); measured on CPU
# (gloo, CPU bf16 kernels): 1.0e-2 before, 1.7e-2 after, for moves of 16-24 nats a row.
UPDATED_TOLERANCE = 2 * BF16_LOG_PROB_TOLERANCE


def job(precision: str) -> JobConfig:
    spec = local_job(colocated=True, total_steps=1, checkpoint_dir=Path("/unused"), every_steps=1)
    config = spec.model_dump(by_alias=True, exclude_none=True)
    config["models"]["actor"]["tiny"] |= {"hiddenSize": 256, "numLayers": 4, "vocabSize": 512}
    config["data"] |= {"maxPromptLength": LENGTH - RESPONSE, "maxResponseLength": RESPONSE}
    config["trainer"] |= {
        "precision": precision,
        "batchSize": ROWS,
        "miniBatchSize": ROWS,
        "microBatchSize": ROWS // 2,
    }
    return JobConfig.model_validate(config)


def experience() -> Experience:
    """Random sequences; even rows are rewarded (advantage +1), odd ones not (-1)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 512, (ROWS, LENGTH), generator=generator)
    response = torch.zeros(ROWS, LENGTH)
    response[:, LENGTH - RESPONSE :] = 1.0
    sign = torch.tensor([1.0 if row % 2 == 0 else -1.0 for row in range(ROWS)])
    zeros = torch.zeros(ROWS, LENGTH)
    return Experience(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=response,
        rollout_log_probs=zeros,
        policy_version=torch.zeros(ROWS, dtype=torch.long),
        old_log_probs=zeros,
        values=zeros,
        advantages=sign[:, None] * response,
        returns=zeros,
    )


@dataclass
class Update:
    parameter_devices: set[str]
    master_dtypes: set[torch.dtype]
    logits_dtype: torch.dtype
    before: torch.Tensor  # (B, T) log-probs of the response tokens, before the update
    after: torch.Tensor  # and after it
    peak_memory_gb: float


def update(rank: int, precision: str) -> Update:
    """One update of a fresh actor on this rank (world size 1: the pool's one GPU)."""
    cuda = torch.cuda.is_available()  # a CPU machine runs it as a check of the test alone
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    actor = Actor(RankInfo(Role.ACTOR, "policy", rank, 1), job(precision))
    batch = experience()
    with torch.no_grad():
        ids = batch.input_ids[:1].to(actor.info.device)
        logits_dtype = actor.model(input_ids=ids).logits.dtype
    before = actor.log_probs(batch).cpu()
    actor.update(replace(batch, old_log_probs=before, rollout_log_probs=before), step=1)
    return Update(
        parameter_devices={p.device.type for p in actor.model.parameters()},
        master_dtypes={p.dtype for p in actor.model.parameters()},
        logits_dtype=logits_dtype,
        before=before,
        after=actor.log_probs(batch).cpu(),
        peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
    )


def both(rank: int) -> dict[str, Update]:
    return {precision: update(rank, precision) for precision in ("fp32", "bf16")}


def test_a_bf16_update_on_cuda_matches_the_fp32_one_within_bf16s_precision() -> None:
    (updates,) = run_ranks(both, 1)
    fp32, bf16 = updates["fp32"], updates["bf16"]
    for result in (fp32, bf16):
        assert result.parameter_devices == {"cuda"}
        assert result.master_dtypes == {torch.float32}
    assert (fp32.logits_dtype, bf16.logits_dtype) == (torch.float32, torch.bfloat16)
    response = experience().response_mask.bool()
    # The same starting weights: the two precisions agree before the update...
    start = (bf16.before - fp32.before)[response].abs().max().item()
    assert start < BF16_LOG_PROB_TOLERANCE, start
    # ...and the update moves each the same way: rewarded rows up, the others down.
    moved = {name: ((r.after - r.before) * response).sum(1) for name, r in updates.items()}
    sign = experience().advantages.sum(1).sign()
    for name, change in moved.items():
        assert bool((change * sign > 0).all()), (name, change)
    end = (bf16.after - fp32.after)[response].abs().max().item()
    print(f"bf16 vs fp32 log-probs: {start:.2e} before, {end:.2e} after the update; "
          f"moved {moved['fp32'].abs().mean():.3f} nats a row; "
          f"peak {fp32.peak_memory_gb:.2f}/{bf16.peak_memory_gb:.2f} GB")  # fmt: skip
    assert end < UPDATED_TOLERANCE, end
