"""Placement and worker-group logic that needs no Ray: bundles, shares, rank order,
batch sharding, and a plain worker run in this process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from rlhf_trainer.algo.experience import Sequences
from rlhf_trainer.api.config import Role
from rlhf_trainer.api.names import pool_resource
from rlhf_trainer.api.plan import plan_placement
from rlhf_trainer.cluster.placement import (
    PlacementTimeout,
    _not_ready_message,
    gpu_bundle,
    gpu_share,
    pool_bundles,
    rank_order,
    role_slots,
)
from rlhf_trainer.worker import RankInfo, concat_batches, free_port, init_distributed, split_batch
from tests.specs import job_config as config
from tests.trainer.toy_workers import PartialSums

SPLIT = config(
    [{"name": "a", "replicas": 2, "gpusPerNode": 2}, {"name": "b", "gpusPerNode": 4}],
    {"actor": "a", "rollout": "a", "ref": "a", "critic": "b", "reward": "b"},
    generation={"tensorParallelSize": 2},
)


def test_one_bundle_per_gpu_pinned_to_the_pool() -> None:
    plan = plan_placement(SPLIT)
    a, b = plan.pools
    assert pool_bundles(a) == [{"GPU": 1, "rlhf-pool-a": 1}] * 4
    assert pool_bundles(b) == [{"GPU": 1, pool_resource("b"): 1}] * 4
    assert gpu_bundle("a") == {"GPU": 1, "rlhf-pool-a": 1}


def test_colocated_roles_share_each_gpu() -> None:
    a, b = plan_placement(SPLIT).pools
    assert gpu_share(a) == pytest.approx(1 / 3)  # actor, rollout, ref
    assert gpu_share(b) == pytest.approx(1 / 2)  # critic, reward
    assert gpu_share(a) * len(a.roles) <= 1


def test_ranks_of_a_node_are_consecutive() -> None:
    # PACK may number bundles across nodes in any order.
    assert rank_order(["n2", "n1", "n2", "n1"]) == [0, 2, 1, 3]
    assert rank_order(["n1", "n1", "n2"]) == [0, 1, 2]
    assert rank_order([]) == []


def test_slots_of_colocated_roles_are_the_same_bundles() -> None:
    plan = plan_placement(SPLIT)
    order = [0, 2, 1, 3]
    critic = role_slots(plan, Role.CRITIC, order)
    reward = role_slots(plan, Role.REWARD, order)
    assert [s.bundle_index for s in critic] == [s.bundle_index for s in reward] == order
    assert {s.pool for s in critic} == {"b"}
    assert [s.bundle_index for s in role_slots(plan, Role.ACTOR, order)] == order
    # rollout engines of 2 GPUs each: rank r sits in the first bundle of its slice
    assert [s.bundle_index for s in role_slots(plan, Role.ROLLOUT, order)] == [0, 1]
    with pytest.raises(ValueError, match="pool a has 4 bundles"):
        role_slots(plan, Role.ACTOR, [0, 1])


def test_a_rule_based_reward_has_no_slots() -> None:
    plan = plan_placement(
        config(
            [{"name": "a", "gpusPerNode": 1}],
            {"actor": "a", "rollout": "a", "ref": "a", "critic": "a"},
            models={"actor": {"path": "m"}, "reward": {"function": "toy_copy"}},
        )
    )
    with pytest.raises(ValueError, match="runs on the driver"):
        role_slots(plan, Role.REWARD, [0])


def test_timeout_message_names_the_pool_and_what_it_asked_for() -> None:
    message = _not_ready_message(
        "policy",
        [gpu_bundle("policy")] * 4,
        5,
        total={"GPU": 3, "rlhf-pool-policy": 2, "CPU": 8},
        free={"GPU": 1, "rlhf-pool-policy": 0},
    )
    assert message.startswith("pool 'policy': placement group not ready after 5 s.")
    assert "4 bundle(s) of {'GPU': 1, 'rlhf-pool-policy': 1} (GPU=4, rlhf-pool-policy=4)" in message
    assert (
        "the cluster has GPU=3, rlhf-pool-policy=2 in all, GPU=1, rlhf-pool-policy=0 free"
        in message
    )
    assert "the resource 'rlhf-pool-policy' and the label rlhf.dev/pool=policy?" in message
    assert issubclass(PlacementTimeout, TimeoutError)


@pytest.mark.parametrize(
    ("rows", "parts", "sizes"), [(6, 3, [2, 2, 2]), (5, 2, [3, 2]), (2, 3, [1, 1, 0])]
)
def test_split_along_the_batch_and_rejoin(rows: int, parts: int, sizes: list[int]) -> None:
    ids = torch.arange(rows * 4).reshape(rows, 4)
    batch = Sequences(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(rows, 4),
        rollout_log_probs=-torch.arange(rows * 4.0).reshape(rows, 4),
        policy_version=torch.arange(rows),
    )
    shards = split_batch(batch, parts)
    assert [len(s) for s in shards] == [len(s.policy_version) for s in shards] == sizes
    rejoined = concat_batches(shards)
    for name, tensor in batch.tensors().items():
        assert torch.equal(rejoined.tensors()[name], tensor), name
    assert torch.equal(concat_batches(split_batch(ids, parts)), ids)


def test_a_batch_refuses_tensors_of_different_batch_sizes() -> None:
    with pytest.raises(ValueError, match="disagree on the batch dimension"):
        Sequences(
            input_ids=torch.zeros(3, 2),
            attention_mask=torch.zeros(3, 2),
            response_mask=torch.zeros(3, 2),
            rollout_log_probs=torch.zeros(3, 2),
            policy_version=torch.zeros(4),
        )


def test_a_plain_worker_runs_without_ray() -> None:
    info = RankInfo(Role.CRITIC, "value", rank=0, world_size=1)
    init_distributed(info, "127.0.0.1", free_port())
    try:
        worker = PartialSums(info)
        assert worker.total_sum(torch.arange(5.0)) == 10.0
    finally:
        dist.destroy_process_group()


def test_the_operator_uses_the_placement_names_without_ray_or_torch() -> None:
    # The operator image has neither: importing its renderer must not pull them in.
    code = (
        "import sys, rlhf_operator.app.handlers, rlhf_trainer.api.plan, rlhf_trainer.api.names; "
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
