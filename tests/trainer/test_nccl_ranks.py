"""A STAND-IN for vLLM's NCCL weight transfer across several engines of TP workers:
NCCL cannot run here, so a gloo group stands in for vLLM's `PyNcclCommunicator`.

Everything else is vLLM's or ours, unmocked: the sender opens its end with vLLM's
`nccl_common.trainer_init` on the world our `trainer_init_info` gives; vLLM's NCCL
worker payload (`worker_init_payload`, rank_offset 1) goes through our fan-out
(`EngineFanOut.init_weight_transfer_engine`), and each worker process calls vLLM's
`nccl_common.worker_init_process_group` with its engine's payload and a parallel
config shaped like vLLM's (rank within the engine, world_size = TP, data-parallel
index 0: each engine is a vLLM instance of its own). Patched in the processes: vLLM's
`stateless_init_process_group` (to build the gloo group, from vLLM's
`StatelessProcessGroup`, at the rank vLLM computed) and torch's
`accelerator.current_device_index` (vLLM asks it for the NCCL device; there is none).

One pool of processes runs every case, one after another (each process imports vLLM
once: the slow part). The last case is the old payload, the same rank_offset for every
engine: two workers claim rank 1, and the rendezvous never completes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_trainer.rollout.weight_sync import EngineFanOut, TransferSetup

pytestmark = pytest.mark.slow

CASES = [(engines, tp) for tp in (1, 2) for engines in (1, 2, 3)]  # (engines, TP workers)
PROCESSES = 1 + max(engines * tp for engines, tp in CASES)
TIMEOUT_S = 20.0
COLLIDING_TIMEOUT_S = 4.0  # the old payload: the rendezvous is expected to fail


@dataclass(frozen=True)
class EngineParallel:
    """The fields of vLLM's ParallelConfig that `worker_init_process_group` reads."""

    rank: int  # the worker's rank within its engine
    world_size: int  # TP x PP of the engine
    data_parallel_index: int = 0


@dataclass(frozen=True)
class Case:
    trainer: dict[str, Any]  # the sender's rendezvous: master_address, _port, world_size
    payloads: list[dict[str, Any]]  # per engine, what its workers receive
    tp: int
    timeout_s: float
    weights: torch.Tensor

    @property
    def workers(self) -> int:
        return len(self.payloads) * self.tp


class Recorder(EngineFanOut):
    """Our fan-out, recording what each engine would be sent."""

    def __init__(self, engines: int, tp: int) -> None:
        self.engines, self.workers_per_engine, self.sent = engines, tp, []

    @property
    def engine_count(self) -> int:
        return self.engines

    def submit_each(self, method: str, firsts: Any) -> None:
        self.sent = list(firsts)

    def wait(self, sent: Any) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def case(engines: int, tp: int, same_offset: bool = False) -> Case:
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_payload,
    )

    from rlhf_trainer.rollout.transfer_engines import trainer_init_info

    port = free_port()
    setup = TransferSetup("127.0.0.1", port, engines, (), 1, TIMEOUT_S, "nccl", tp)
    trainer = trainer_init_info(0, setup)
    # What vLLM's NCCLTrainerWeightTransferEngine.trainer_init hands the client.
    sent = worker_init_payload(
        NCCLWeightTransferInitInfo(
            master_address="127.0.0.1", master_port=port, rank_offset=1,
            world_size=trainer.world_size,
        )
    )  # fmt: skip
    if same_offset:  # the old behaviour: one payload for all, a rank per engine
        world, payloads = 1 + engines, [sent | {"world_size": 1 + engines}] * engines
    else:
        fan_out = Recorder(engines, tp)
        fan_out.init_weight_transfer_engine(sent)
        world, payloads = trainer.world_size, fan_out.sent
    rendezvous = {"master_address": "127.0.0.1", "master_port": port, "world_size": world}
    timeout = COLLIDING_TIMEOUT_S if same_offset else TIMEOUT_S
    return Case(rendezvous, payloads, tp, timeout, torch.arange(8.0) * (engines + 10 * tp))


def run_cases(index: int, cases: list[Case], out: Path) -> None:
    """Process `index` of the pool: the sender (0) or a worker, in every case."""
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer import nccl_common

    from rlhf_trainer.rollout.transfer_memory import SyncGroup

    timeout_s = TIMEOUT_S

    def gloo_stand_in(address: str, port: int, rank: int, world: int, device: Any) -> SyncGroup:
        pg = StatelessProcessGroup.create(address, port, rank, world, store_timeout=int(timeout_s))
        return SyncGroup.over(pg.store, rank, world, timedelta(seconds=timeout_s))

    nccl_common.stateless_init_process_group = gloo_stand_in
    torch.accelerator.current_device_index = lambda: 0  # no accelerator here
    torch.set_num_threads(1)
    for number, this in enumerate(cases):
        if index > this.workers:
            continue
        timeout_s = this.timeout_s
        try:
            if index == 0:
                group = nccl_common.trainer_init(this.trainer, rank=0)
                received = this.weights.clone()
            else:
                engine, rank = divmod(index - 1, this.tp)
                info = nccl_info(**this.payloads[engine])
                group = nccl_common.worker_init_process_group(info, EngineParallel(rank, this.tp))
                received = torch.zeros_like(this.weights)
            group.broadcast(received)
            group.close()
            result: Any = received
        except Exception as error:  # the colliding case's expected end
            result = f"{type(error).__name__}: {error}"
        torch.save(result, out / f"case-{number}-process-{index}.pt")


def nccl_info(**payload: Any) -> Any:
    """vLLM's worker init info, parsed from the payload as vLLM's worker does."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    return NCCLWeightTransferInitInfo(**payload)


def test_every_engine_worker_joins_one_group_and_gets_the_weights(tmp_path: Path) -> None:
    cases = [case(engines, tp) for engines, tp in CASES] + [case(2, 1, same_offset=True)]
    torch.multiprocessing.spawn(run_cases, (cases, tmp_path), nprocs=PROCESSES, join=True)
    for number, ((engines, tp), this) in enumerate(zip(CASES, cases, strict=False)):
        assert this.trainer["world_size"] == 1 + engines * tp
        offsets = [p["rank_offset"] for p in this.payloads]
        assert offsets == [1 + e * tp for e in range(engines)]
        for index in range(this.workers + 1):
            received = torch.load(tmp_path / f"case-{number}-process-{index}.pt")
            assert isinstance(received, torch.Tensor), (engines, tp, index, received)
            assert torch.equal(received, this.weights), (engines, tp, index)
    old = len(CASES)  # same rank_offset for both engines: ranks collide, nobody joins
    ends = [torch.load(tmp_path / f"case-{old}-process-{i}.pt") for i in range(3)]
    assert all(isinstance(end, str) for end in ends), ends
