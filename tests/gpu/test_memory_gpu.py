"""The memory estimate (api.memory) against CUDA's own count: one actor rank's peak over
a real update, `torch.cuda.max_memory_allocated`, on a model big enough that the terms
are GiB, in both precisions. The CPU check of the same terms is tests/unit/test_memory.py;
here CUDA's kernels (SDPA's, cuBLAS's) and FSDP2 over NCCL decide what is held."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.memory import memory_plan
from tests.gpu.machine import needs
from tests.trainer.distributed import run_ranks
from tests.unit.test_memory import MEASURED_WITHIN, PRECISIONS, experience, role, tiny_job

pytestmark = needs(gpus=1)

# 8 layers of 1024 (8 heads of 128), a 32000-token vocabulary: 0.36e9 parameters.
MODEL = {"hiddenSize": 1024, "numLayers": 8, "numHeads": 8, "vocabSize": 32000}
ROWS, LENGTH = 8, 512


def update_peak(rank: int) -> dict[str, int]:
    """Each precision's peak of CUDA's allocator over one update of a fresh actor (its
    optimizer's states made at the step), from before the actor is built."""
    from rlhf_trainer.roles.policy import Actor
    from rlhf_trainer.worker import RankInfo

    peaks = {}
    for precision in PRECISIONS:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        config = tiny_job(precision, MODEL, ROWS, LENGTH)
        actor = Actor(RankInfo(Role.ACTOR, "policy", rank, 1), config)
        actor.update(experience(ROWS, LENGTH, MODEL["vocabSize"]), step=1)
        peaks[precision] = torch.cuda.max_memory_allocated()
        del actor
    return peaks


def test_an_actor_update_peaks_where_the_estimate_says() -> None:
    """The estimate's weights, gradients and optimizer states, plus the larger of the
    activations and the step: what one actor rank's update holds at its peak (the
    runtime and the weight sync's buffers are not the allocator's, or not in an update)."""
    (peaks,) = run_ranks(update_peak, 1)
    for precision, peak in peaks.items():
        (pool,) = memory_plan(tiny_job(precision, MODEL, ROWS, LENGTH))
        actor = role(pool, Role.ACTOR)
        estimate = actor.resident_bytes - actor.runtime_bytes + actor.working_bytes
        print(
            f"{precision}: peak {peak / 2**30:.2f} GiB measured, {estimate / 2**30:.2f} estimated"
        )
        assert estimate == pytest.approx(peak, rel=MEASURED_WITHIN), precision
