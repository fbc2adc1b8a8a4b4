"""The job's weight transfer (api.transfer.choose_transfer) on every example and on the
planner's layouts: the backend, the NCCL world and each engine's rank offset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.api.transfer import Backend, NcclRanks, choose_transfer, nccl_ranks
from tests.specs import job_config as config
from tests.unit.conftest import EXAMPLES, load

HOST, IPC, NCCL = Backend.HOST, Backend.IPC, Backend.NCCL

# example -> (backend with CUDA, world size, per-engine rank offsets)
EXPECTED = {
    "agentic-cluster.yaml": (HOST, 2, (1,)),  # device: cpu
    "agentic-tools.yaml": (IPC, 2, (1,)),  # on a GPU machine; HOST without CUDA
    "asymmetric-3-5.yaml": (IPC, 4, (1, 2, 3)),
    "asymmetric-6-2.yaml": (IPC, 7, (1, 2, 3, 4, 5, 6)),
    "colocated.yaml": (IPC, 9, (1, 2, 3, 4, 5, 6, 7, 8)),
    "cpu-cluster.yaml": (HOST, 2, (1,)),  # device: cpu
    "fully-async.yaml": (NCCL, 9, (1, 2, 3, 4, 5, 6, 7, 8)),
    "grpo-split.yaml": (NCCL, 9, (1, 3, 5, 7)),  # 4 engines of TP 2
    "local-cpu.yaml": (IPC, 2, (1,)),  # on a GPU machine; HOST without CUDA
    "lora-grpo.yaml": (IPC, 9, (1, 3, 5, 7)),  # planned; the adapter itself goes by Ray
    "split-8gpu-4-4.yaml": (IPC, 5, (1, 2, 3, 4)),
    "two-nodes-by-node-8-8.yaml": (IPC, 9, (1, 3, 5, 7)),
    "two-nodes-per-node-4-4.yaml": (IPC, 9, (1, 3, 5, 7)),
}


def test_every_example_is_listed_here() -> None:
    assert sorted(p.name for p in EXAMPLES) == sorted(EXPECTED)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_takes_its_transfer(path: Path) -> None:
    job_config = parse_job(load(path)).spec.job_config()  # what the trainer reads
    backend, world, offsets = EXPECTED[path.name]
    chosen = choose_transfer(job_config, cuda=True)
    assert (chosen.backend, chosen.ranks) == (backend, NcclRanks(world, offsets))
    # Without CUDA every job takes the host transfer, with the same ranks.
    assert choose_transfer(job_config, cuda=False).backend is HOST


SPLIT_ROLES = {"actor": "a", "rollout": "a", "ref": "a", "critic": "b", "reward": "b"}
APART = {"actor": "a", "rollout": "b", "ref": "a", "critic": "a", "reward": "a"}


def two_pools(a: dict[str, Any], b: dict[str, Any], roles: dict[str, str], tp: int = 1) -> Any:
    pools = [{"name": "a", **a}, {"name": "b", **b}]
    return config(pools, roles, generation={"tensorParallelSize": tp})


@pytest.mark.parametrize(
    ("job", "backend", "world", "offsets"),
    [
        # test_plan's layouts
        (two_pools({"gpusPerNode": 4}, {"gpusPerNode": 4}, SPLIT_ROLES), IPC, 5, (1, 2, 3, 4)),
        (two_pools({"replicas": 2, "gpusPerNode": 4}, {"replicas": 2, "gpusPerNode": 4},
                   SPLIT_ROLES, tp=2), IPC, 9, (1, 3, 5, 7)),
        (two_pools({"gpusPerNode": 6}, {"gpusPerNode": 2}, SPLIT_ROLES), IPC, 7, (1, 2, 3, 4, 5, 6)),
        # the rollout on a pool of its own: NCCL, one rank per TP worker of every engine
        (two_pools({"gpusPerNode": 8}, {"gpusPerNode": 8}, APART), NCCL, 9, tuple(range(1, 9))),
        (two_pools({"gpusPerNode": 8}, {"replicas": 2, "gpusPerNode": 4}, APART, tp=2),
         NCCL, 9, (1, 3, 5, 7)),
        (two_pools({"gpusPerNode": 2}, {"gpusPerNode": 6}, APART, tp=2), NCCL, 7, (1, 3, 5)),
        # a CPU pool in a GPU job: the host transfer on both sides, whichever it is
        (two_pools({"gpusPerNode": 1, "device": "cpu"}, {"gpusPerNode": 8}, APART), HOST, 9,
         tuple(range(1, 9))),
        (two_pools({"gpusPerNode": 8}, {"gpusPerNode": 2, "device": "cpu"}, APART), HOST, 3,
         (1, 2)),
        (two_pools({"gpusPerNode": 4, "device": "cpu"}, {"gpusPerNode": 4}, SPLIT_ROLES), HOST,
         5, (1, 2, 3, 4)),
        # a CPU pool that holds neither the actor nor the rollout changes nothing
        (two_pools({"gpusPerNode": 4}, {"gpusPerNode": 4, "device": "cpu"}, SPLIT_ROLES), IPC,
         5, (1, 2, 3, 4)),
    ],
)  # fmt: skip
def test_each_layout_takes_its_transfer(
    job: Any, backend: Backend, world: int, offsets: tuple[int, ...]
) -> None:
    chosen = choose_transfer(job, cuda=True)
    assert (chosen.backend, chosen.ranks) == (backend, NcclRanks(world, offsets))
    assert chosen.why


def test_nccl_ranks_follow_the_engines_before() -> None:
    assert nccl_ranks(1, 1) == NcclRanks(2, (1,))
    assert nccl_ranks(3, 2) == NcclRanks(7, (1, 3, 5))
    assert nccl_ranks(2, 4, first=1) == NcclRanks(9, (1, 5))
    with pytest.raises(ValueError, match="at least one engine"):
        nccl_ranks(0, 2)
