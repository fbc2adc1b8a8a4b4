"""A failed weight push never hangs an actor of several ranks, on any backend.

Each item of the policy's weight source is an FSDP all-gather over every actor rank,
and only rank 0 talks to the engines. With 2 and 4 actor ranks (real gloo processes),
rollout rank 1 dies at each point of a push (before the start, after 1 of n tensors or
buckets, at the finish) on vLLM's NCCL and IPC senders and on ours, or stalls there
(alive, never done) until its phase's deadline; every rank must leave the push with the
same verdict, naming the engine and the call it failed in (a stall: the phase, and the
bytes moved of the push's). A
rank that waited in a gather or a barrier for a peer that had left ends in gloo's
timeout error instead (`push_fault_ranks.GROUP_TIMEOUT`), which fails the case. After
each backend's faults, a push that succeeds hands rollout rank 0 the policy whole, by
value: the group and the source go on. The stand-ins are named in push_fault_ranks.
"""

from __future__ import annotations

import multiprocessing
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch.multiprocessing

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.rollout.sync_deadlines import PHASES, Stall
from rlhf_trainer.rollout.weight_sync import HOST_TRANSFER
from tests.specs import local_job
from tests.trainer import distributed, push_fault_ranks
from tests.trainer.push_fault_ranks import Case, fault_matrix, push_cases

CASES = fault_matrix()


def tiny_job(ranks: int, tmp: Path) -> JobConfig:
    """The local example's job with an actor of `ranks` ranks and a smaller tiny model."""
    job = local_job(colocated=True, total_steps=1, checkpoint_dir=tmp, every_steps=1)
    spec = job.model_dump(by_alias=True, exclude_none=True)
    spec["pools"][0]["gpusPerNode"] = ranks
    spec["models"]["actor"]["tiny"] |= {"hiddenSize": 64, "numHeads": 2}
    return JobConfig.model_validate(spec)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ranks: f"{ranks} ranks")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[list[str]]:
    """Each actor rank's outcome of every case ([rank][case]), from one run of the
    ranks per world size. The ranks are forked from a server that imported their module
    once: spawned, each would import torch, transformers and vLLM again (~6 CPU-s)."""
    ranks = request.param
    job = tiny_job(ranks, tmp_path_factory.mktemp("checkpoints"))
    multiprocessing.set_forkserver_preload([push_fault_ranks.__name__])
    forked = partial(torch.multiprocessing.start_processes, start_method="forkserver")
    with mock.patch.object(distributed.mp, "spawn", forked):
        results: list[list[str]] = distributed.run_ranks(push_cases, ranks, job, CASES)
    return results


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_actor_rank_leaves_the_push_with_the_same_verdict(
    outcomes: list[list[str]], case: Case
) -> None:
    index = CASES.index(case)
    verdicts = [ranks[index] if index < len(ranks) else "not run: a case before broke the group"
                for ranks in outcomes]  # fmt: skip
    if case.fault is None:
        assert verdicts == ["ok"] * len(outcomes)
        return
    assert len(set(verdicts)) == 1, "\n".join(
        f"actor rank {r}: {v}" for r, v in enumerate(verdicts)
    )
    assert verdicts[0].startswith("PushFailed: "), verdicts[0]
    # Where it failed: the sender, on the engine's call (the other ranks did not fail).
    if not case.stalls:
        assert "failed: actor rank 0: rollout rank 1 on pool rollout died in " in verdicts[0]
        assert verdicts[0].endswith(f"died in {case.method}"), verdicts[0]
        return
    assert f"failed: actor rank 0: weight transfer, {case.method} on every engine: " in verdicts[0]
    stall = Stall.found_in(RuntimeError(verdicts[0]))
    assert stall is not None and stall.phase == PHASES[case.method], verdicts[0]
    # An NCCL broadcast waits for every receiver: rank 0 then waits for the next tensor,
    # in the same update, and is named with rank 1 (it is stuck in the receive as well).
    in_broadcast = case.backend == "nccl" and stall.phase == "bucket"
    assert stall.ranks == ((0, 1) if in_broadcast else (1,)), verdicts[0]
    assert stall.total > 0, verdicts[0]  # the push's bytes, known from its start
    # Bytes moved: none before the start; all before the finish; after 1 of n, the
    # first of the host transfer's buckets (NCCL and unpacked IPC update in one call).
    moved = {"start": 0, "finish": stall.total}.get(stall.phase)
    if moved is not None:
        assert stall.moved == moved, verdicts[0]
    elif case.backend == HOST_TRANSFER:
        assert 0 < stall.moved < stall.total, verdicts[0]
    else:
        assert stall.moved == 0, verdicts[0]
