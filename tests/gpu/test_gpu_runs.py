"""Whole 3-step jobs on GPU pools through the local Ray cluster (`local_ray_cluster`,
which gives each simulated node CUDA devices of its own), in bf16 as GPU jobs train:
vLLM's CUDA engines take the actor's weights over the backend the placement chooses,
CUDA IPC on a shared GPU and NCCL to engines on GPUs of their own, and sample with them
(the engines' log-probs against the actor's, after every push, within bf16's precision).

Never run by this project's CI, which has no GPU: `make test-gpu` on a GPU node."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.transfer import Backend, choose_transfer
from tests.gpu.machine import needs
from tests.specs import local_job

if TYPE_CHECKING:
    from rlhf_trainer.loop.sync import StepResult

STEPS = 3
# vLLM's bf16 kernels against the actor's bf16 compute (tests/trainer/test_precision.py).
BF16_LOG_PROB_TOLERANCE = 0.05

pytestmark = pytest.mark.slow


def gpu_job(
    tmp: Path, pools: list[dict[str, Any]], roles: dict[str, str], tensor_parallel: int = 1
) -> JobConfig:
    """The local example on `pools`, in bf16, for STEPS steps, its engines of
    `tensor_parallel` GPUs each."""
    spec = local_job(colocated=True, total_steps=STEPS, checkpoint_dir=tmp, every_steps=100)
    config = spec.model_dump(by_alias=True, exclude_none=True)
    config |= {"pools": pools, "roles": roles}
    config["generation"] |= {"tensorParallelSize": tensor_parallel}
    config["trainer"] |= {"precision": "bf16"}
    return JobConfig.model_validate(config)


def assert_trained_with_the_actors_weights(
    config: JobConfig, on_step: Callable[[StepResult], None] | None = None
) -> None:
    from tests.trainer.local_runs import train  # the trainer's loop: Ray, vLLM, the env's server

    trained = train(config, on_step=on_step)
    assert [s.step for s in trained.steps] == list(range(1, STEPS + 1))
    diffs = [s.rollout_log_prob_diff for s in trained.steps]
    print(f"{choose_transfer(config, cuda=True).backend}: engine vs actor per step {diffs}")
    assert max(diffs) < BF16_LOG_PROB_TOLERANCE, diffs
    assert all(math.isfinite(s.actor.policy_loss) for s in trained.steps)


@needs(gpus=1, vllm=True, ray=True)
def test_a_job_on_one_gpu_pushes_over_cuda_ipc(tmp_path: Path) -> None:
    pools = [{"name": "policy", "replicas": 1, "gpusPerNode": 1}]
    roles = {"actor": "policy", "rollout": "policy", "ref": "policy", "critic": "policy"}
    config = gpu_job(tmp_path, pools, roles)
    assert choose_transfer(config, cuda=True).backend is Backend.IPC
    assert_trained_with_the_actors_weights(config)


@needs(gpus=3, vllm=True, ray=True)
def test_a_split_job_pushes_to_two_engines_over_nccl(tmp_path: Path) -> None:
    pools = [
        {"name": "policy", "replicas": 1, "gpusPerNode": 1},
        {"name": "generation", "replicas": 1, "gpusPerNode": 2},
    ]
    roles = {"actor": "policy", "rollout": "generation", "ref": "policy", "critic": "policy"}
    config = gpu_job(tmp_path, pools, roles)
    transfer = choose_transfer(config, cuda=True)
    assert transfer.backend is Backend.NCCL
    assert transfer.ranks.world_size == 3  # the sender and two engines of one GPU each
    assert_trained_with_the_actors_weights(config)


ALL_ON_POLICY = {"actor": "policy", "rollout": "policy", "ref": "policy", "critic": "policy"}


@needs(gpus=2, vllm=True, ray=True)
def test_a_tp2_engine_beside_a_two_rank_actor_pushes_over_cuda_ipc(tmp_path: Path) -> None:
    """vLLM's Ray executor puts the engine's two workers on the pool's two bundles, each
    beside an actor rank on its GPU (docs/concepts/placement.md)."""
    pools = [{"name": "policy", "replicas": 1, "gpusPerNode": 2}]
    config = gpu_job(tmp_path, pools, ALL_ON_POLICY, tensor_parallel=2)
    assert choose_transfer(config, cuda=True).backend is Backend.IPC
    assert_trained_with_the_actors_weights(config)


@needs(gpus=4, vllm=True, ray=True)
def test_a_killed_tp2_engine_is_replaced_and_served_over_nccl(tmp_path: Path) -> None:
    """A two-rank actor on one pool, one engine of two GPUs on another; the engine's rank
    is killed (its engine core and, with it, the vLLM workers it owns) after step 1. A
    new engine starts on the same two bundles, takes the weights over NCCL, and the run
    ends with the engines serving the actor's weights at every step."""
    from tests.trainer.local_runs import EngineKiller

    pools = [
        {"name": "policy", "replicas": 1, "gpusPerNode": 2},
        {"name": "generation", "replicas": 1, "gpusPerNode": 2},
    ]
    roles = ALL_ON_POLICY | {"rollout": "generation"}
    config = gpu_job(tmp_path, pools, roles, tensor_parallel=2)
    transfer = choose_transfer(config, cuda=True)
    assert transfer.backend is Backend.NCCL
    assert transfer.ranks.world_size == 3  # the sender and the engine's two workers
    killer = EngineKiller(after_step=1, whole_rank=True)
    with killer.tagged():
        assert_trained_with_the_actors_weights(config, on_step=killer)
    assert len(killer.killed) == 1
