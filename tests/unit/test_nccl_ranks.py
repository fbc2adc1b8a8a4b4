"""A STAND-IN for vLLM's NCCL weight transfer across several engines of TP workers:
NCCL cannot run here, so a gloo group stands in for vLLM's `PyNcclCommunicator`.

Everything else is vLLM's or ours, unmocked: the sender opens its end with vLLM's
`nccl_common.trainer_init` on the world our `trainer_init_info` gives; vLLM's NCCL
worker payload (`worker_init_payload`, rank_offset 1) goes through our fan-out
(`EngineFanOut.init_weight_transfer_engine`), and each worker calls vLLM's
`nccl_common.worker_init_process_group` with its engine's payload and a parallel config
shaped like vLLM's (rank within the engine, world_size = TP, data-parallel index 0: each
engine is a vLLM instance of its own). Patched: vLLM's `stateless_init_process_group`
(to build the gloo group, over vLLM's `StatelessProcessGroup`'s store, at the rank vLLM
computed) and torch's `accelerator.current_device_index` (vLLM asks it for the NCCL
device; there is none).

The sender and the workers are threads of this process, each with a gloo group of its
own (a process each would import vLLM once per worker: minutes on 2 cores). The last
case is the old payload, the same rank_offset for every engine: two workers claim rank 1,
and the rendezvous fails.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch

from rlhf_trainer.rollout.weight_sync import EngineFanOut, TransferSetup

TIMEOUT_S = 20.0
COLLIDING_TIMEOUT_S = 3.0  # the old payload: the rendezvous is expected to fail


@dataclass(frozen=True)
class EngineParallel:
    """The fields of vLLM's ParallelConfig that `worker_init_process_group` reads."""

    rank: int  # the worker's rank within its engine
    world_size: int  # TP x PP of the engine
    data_parallel_index: int = 0


class Recorder(EngineFanOut):
    """Our fan-out, recording what each engine would be sent."""

    def __init__(self, engines: int, tp: int) -> None:
        self.engines, self.workers_per_engine = engines, tp
        self.sent: list[dict[str, Any]] = []

    @property
    def engine_count(self) -> int:
        return self.engines

    def submit_each(self, method: str, firsts: Any) -> None:
        self.sent = list(firsts)

    def answers(self, sent: Any) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gloo_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer import nccl_common

    from rlhf_trainer.rollout.transfer_memory import SyncGroup

    def stand_in(address: str, port: int, rank: int, world: int, device: Any) -> SyncGroup:
        timeout = float(threading.current_thread().name.split(":")[1])
        pg = StatelessProcessGroup.create(address, port, rank, world, store_timeout=int(timeout))
        return SyncGroup.over(pg.store, rank, world, timedelta(seconds=timeout))

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", stand_in)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)


def payloads(
    engines: int, tp: int, same_offset: bool
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The sender's rendezvous, and what each engine's workers receive."""
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_payload,
    )

    from rlhf_trainer.rollout.transfer_engines import trainer_init_info

    port = free_port()
    setup = TransferSetup("127.0.0.1", port, engines, (), 1, TIMEOUT_S, "nccl", tp)
    world = trainer_init_info(0, setup).world_size
    # What vLLM's NCCLTrainerWeightTransferEngine.trainer_init hands the client.
    sent = worker_init_payload(
        NCCLWeightTransferInitInfo(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world
        )
    )
    if same_offset:  # the old behaviour: one payload for all, one rank per engine
        world = 1 + engines
        each = [sent | {"world_size": world}] * engines
    else:
        fan_out = Recorder(engines, tp)
        fan_out.init_weight_transfer_engine(sent)
        each = fan_out.sent
    return {"master_address": "127.0.0.1", "master_port": port, "world_size": world}, each


def broadcast(engines: int, tp: int, same_offset: bool = False) -> list[Any]:
    """The weights each member received (the sender's first), or the error it ended with."""
    from vllm.distributed.weight_transfer import nccl_common
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    trainer, each = payloads(engines, tp, same_offset)
    weights = torch.arange(8.0) * (engines + 10 * tp)
    results: list[Any] = [None] * (1 + engines * tp)

    def member(index: int) -> None:
        try:
            if index == 0:
                group = nccl_common.trainer_init(trainer, rank=0)
                received = weights.clone()
            else:
                engine, rank = divmod(index - 1, tp)
                info = NCCLWeightTransferInitInfo(**each[engine])  # as vLLM's worker parses it
                group = nccl_common.worker_init_process_group(info, EngineParallel(rank, tp))
                received = torch.zeros_like(weights)
            group.broadcast(received)
            group.close()
            results[index] = received
        except Exception as error:  # the colliding case's expected end
            results[index] = f"{type(error).__name__}: {error}"

    timeout = COLLIDING_TIMEOUT_S if same_offset else TIMEOUT_S
    threads = [threading.Thread(target=member, args=(i,), name=f"member-{i}:{timeout}", daemon=True)
               for i in range(len(results))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return [weights, *results]


@pytest.mark.usefixtures("gloo_stand_in")
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("engines", [1, 2, 3])
def test_every_engine_worker_joins_one_group_and_gets_the_weights(engines: int, tp: int) -> None:
    trainer, each = payloads(engines, tp, same_offset=False)
    assert trainer["world_size"] == 1 + engines * tp
    assert [p["rank_offset"] for p in each] == [1 + e * tp for e in range(engines)]
    weights, *received = broadcast(engines, tp)
    for index, got in enumerate(received):
        assert isinstance(got, torch.Tensor), (index, got)
        assert torch.equal(got, weights), index


@pytest.mark.usefixtures("gloo_stand_in")
def test_the_same_rank_offset_for_every_engine_never_forms_the_group() -> None:
    """vLLM's own payload, unchanged for two engines: both claim rank 1."""
    _, *ends = broadcast(2, 1, same_offset=True)
    assert not any(isinstance(end, torch.Tensor) for end in ends), ends
