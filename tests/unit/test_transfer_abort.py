"""A STAND-IN for NCCL: a rollout engine lost in the middle of vLLM's NCCL broadcast.

vLLM's NCCL sender (`NCCLTrainerWeightTransferEngine.send_weights`) runs the engines'
`update_weights` call on a side thread and broadcasts beside it. NCCL's broadcast waits
for every peer and has no timeout of its own: without an abort, a sender whose engine
died waits for ever. Our fan-out tells `on_failure` when a call fails, and the actor
aborts its end of the transfer there (`push_verdict.WeightPush.abort`, `abort_sender`).
vLLM's own `shutdown` would not do: it drops the communicator that the broadcast loop
still reads (tried here: AttributeError on None in the unpacked loop).

NCCL cannot run here, and a gloo collective cannot stand in: measured with torch 2.13,
`ProcessGroupGloo.abort()` and `shutdown()` from another thread leave a waiting
broadcast to its own timeout. So `tests.nccl_stand_in.StandInCommunicator` stands in
for vLLM's `PyNcclCommunicator` on the sender (that module says how). Also patched:
`torch.cuda.current_stream` (there is no CUDA stream). vLLM's sender, its threads and
its error path, and our fan-out, run unpatched. With several actor ranks, where the
other ranks' gathers are at stake: test_push_verdict.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import pytest
import torch
from torch import nn

from rlhf_trainer.rollout.transfer_engines import PolicySource, abort_sender
from rlhf_trainer.rollout.weight_sync import EngineFanOut
from tests.nccl_stand_in import EngineLost, StandInCommunicator

LAYERS = 3  # tensors broadcast one by one (packed=False: packing needs CUDA streams)
STAND_IN_WAIT_S = 5.0  # NCCL waits for ever; the stand-in says so after this long


class ThreadEngines(EngineFanOut):
    """Two engines as threads: each receives every broadcast tensor in `update_weights`;
    engine 1 dies after the first, as a killed vLLM engine would."""

    def __init__(self, communicator: StandInCommunicator, tensors: int) -> None:
        self.communicator, self.tensors = communicator, tensors
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="engine")
        self.received: list[list[torch.Tensor]] = [[], []]

    @property
    def engine_count(self) -> int:
        return 2

    def submit(self, method: str, *args: Any) -> list[Future[None]]:
        if method != "update_weights":
            done: Future[None] = Future()
            done.set_result(None)
            return [done]
        return [self.pool.submit(self._receive, engine) for engine in range(2)]

    def _receive(self, engine: int) -> None:
        for _ in range(self.tensors):
            self.received[engine].append(self.communicator.receive(engine))
            if engine == 1:
                raise EngineLost("rollout rank 1 on pool rollout died")

    def answers(self, sent: Sequence[Future[None]]) -> None:
        finished, _ = wait(sent, timeout=60, return_when=FIRST_EXCEPTION)
        for future in finished:
            future.result()  # the first failure, as cluster.waits.join raises it


def sender(engines: ThreadEngines, communicator: StandInCommunicator) -> Any:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(LAYERS)))
    source = PolicySource(model, tied=False, dtype=torch.float32)
    transfer = NCCLTrainerWeightTransferEngine(client=engines, source=source, packed=False)
    transfer.model_update_group = communicator  # in vLLM: trainer_init's PyNccl group
    return transfer


@pytest.mark.parametrize("aborts", [True, False], ids=["aborts", "without-the-hook"])
def test_a_sender_whose_engine_dies_mid_broadcast_aborts_and_fails_naming_it(
    aborts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)  # no CUDA here
    communicator = StandInCommunicator(engines=2, wait_s=STAND_IN_WAIT_S)
    engines = ThreadEngines(communicator, LAYERS)
    transfer = sender(engines, communicator)
    aborted: list[bool] = []
    if aborts:  # what push_verdict.open_push installs

        def abort() -> None:
            aborted.append(True)
            abort_sender(transfer)

        engines.on_failure = abort
    try:
        if aborts:
            with pytest.raises(EngineLost, match="rollout rank 1 on pool rollout died"):
                transfer.send_weights()
            assert aborted == [True] and communicator.aborted.is_set()
        else:  # the broadcast to the dead engine waits for ever: NCCL's hang
            with pytest.raises(TimeoutError, match="would wait for ever"):
                transfer.send_weights()
        # The first tensor reached both engines, and the dead one took no more: the
        # sender waited on the second, and broadcast nothing after it.
        assert len(engines.received[0]) >= 1 and len(engines.received[1]) == 1
        assert communicator.sent == 1
    finally:
        communicator.release_receivers()
        engines.pool.shutdown(wait=True)
