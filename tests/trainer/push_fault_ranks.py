"""The actor's ranks of the push fault matrix (test_push_verdict.py). Each rank shards a
tiny policy with FSDP2 over real gloo ranks, so each tensor of a push is a real
all-gather over every rank, and runs the trainer side of the case's backend: vLLM's own
sender (NCCL, IPC) or ours (rlhf_host). Rank 0 drives two engines, threads of its
process, and rollout rank 1 dies at the case's point of the push: on an event (a call,
or a count of tensors taken), never on a timer.

STAND-INS (no GPU here): for NCCL the communicator (`tests.nccl_stand_in`: the engines
take each broadcast tensor from it) and `torch.cuda.current_stream`; for IPC the CUDA
IPC handles (`reduce_tensor`: the stand-in handle carries a copy of the tensor), the
GPU's UUID, and `torch.cuda.synchronize` / `ipc_collect`; both unpacked (vLLM's packing
needs CUDA streams: `transfer_engines.IPC_PACKED` is turned off here). vLLM's senders
(their threads, collectives and error paths), our fan-out, source and push run
unpatched.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.cluster.engine_client import deadline_missed
from rlhf_trainer.roles.policy import Actor
from rlhf_trainer.rollout.sync_deadlines import SyncClock
from rlhf_trainer.rollout.transfer_engines import PolicySource
from rlhf_trainer.rollout.transfer_memory import Segments
from rlhf_trainer.rollout.weight_sync import HOST_TRANSFER, Bucket, EngineFanOut, TransferSetup
from rlhf_trainer.worker import RankInfo
from tests.nccl_stand_in import EngineLost, StandInCommunicator

BACKENDS = ("nccl", "ipc", HOST_TRANSFER)
# How long a rank waits in a collective of the actor's group. None should: a rank that
# does waited for a peer that had left the push, and ends in gloo's timeout error
# instead of the push's verdict.
GROUP_TIMEOUT = timedelta(seconds=60)
STAND_IN_GPU = "GPU-stand-in-0"  # actor rank 0's GPU, which the engines share (IPC)
FAULTS = {  # where rollout rank 1 dies: (the call, tensors or buckets taken before)
    "before the start": ("start_weight_update", 0),
    "after 1 of n": ("update_weights", 1),
    "at the finish": ("finish_weight_update", 0),
}
# Each phase's deadline in a case where rollout rank 1 stalls (alive, never done) at one
# of those points instead; none in the others (the group's timeout is theirs).
STALL_DEADLINE_S = 5.0


@dataclass(frozen=True)
class Case:
    backend: str
    fault: str | None  # a key of FAULTS; None: a push that succeeds
    stalls: bool = False  # rollout rank 1 stalls at the fault, rather than die

    @property
    def method(self) -> str | None:
        return None if self.fault is None else FAULTS[self.fault][0]

    @property
    def taken_before(self) -> int:
        """What rollout rank 1 takes before it dies in update_weights: tensors (NCCL
        receives them one by one), or buckets (rlhf_host). Unpacked IPC sends every
        handle in one update_weights: it dies in that one."""
        if self.fault is None or self.backend == "ipc":
            return 0
        return FAULTS[self.fault][1]

    def __str__(self) -> str:
        return f"{self.backend}, {'stalls' if self.stalls else 'dies'} {self.fault or 'no fault'}"


def fault_matrix() -> list[Case]:
    """Each backend: the engine dies at each point, stalls at each point, then a push
    that succeeds (the actor's group and source go on after a failed push)."""
    return [
        *(Case(b, f, stalls) for b in BACKENDS for stalls in (False, True) for f in FAULTS),
        *(Case(b, None) for b in BACKENDS),
    ]


Sent = tuple[str, int, list[Future[None]]]  # a call: its method, bytes and futures


class DyingEngines(EngineFanOut):
    """Rollout ranks 0 and 1 as threads of the sender's process, each taking its calls
    in the order sent (as a Ray actor does); rank 1 dies at the case's fault and stays
    dead, as a killed engine would, or stalls there until `close`. Engine 0 keeps what
    it loads. Each call is waited for by its phase's deadline (the production clock and
    error: `EngineGroupClient`'s, with futures for Ray's)."""

    def __init__(self, case: Case, communicator: StandInCommunicator | None) -> None:
        self.case, self.communicator = case, communicator
        self.threads = [ThreadPoolExecutor(1, thread_name_prefix=f"rollout-{i}") for i in (0, 1)]
        self.segments = [Segments(), Segments()]
        self.taken = 0  # tensors (NCCL) or update calls, by rollout rank 1
        self.dead = False
        self.loaded: dict[str, Tensor] = {}  # by rollout rank 0
        self.released = threading.Event()  # ends a stall
        self.clock = SyncClock(ceiling_s=STALL_DEADLINE_S if case.stalls else 3600.0)

    @property
    def engine_count(self) -> int:
        return 2

    def submit(self, method: str, *args: Any) -> Sent:
        futures = [t.submit(self._call, e, method, args) for e, t in enumerate(self.threads)]
        return method, self.clock.sent(method, args, self.push_bytes), futures

    def answers(self, sent: Sent) -> None:
        method, nbytes, futures = sent
        began, deadline_s = time.monotonic(), self.clock.deadline_s(method, nbytes)
        done, pending = wait(futures, timeout=deadline_s, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()  # the first failure, as cluster.waits.join raises it
        if pending:
            ranks = [rank for rank, future in enumerate(futures) if future in pending]
            stall = self.clock.stall("rollout", ranks, method)
            raise deadline_missed(method, stall, deadline_s, nbytes, "(stand-in: no probe)")
        self.clock.answered(method, nbytes, began, time.monotonic())

    def _call(self, engine: int, method: str, args: tuple[Any, ...]) -> None:
        if method != "update_weights":
            self._survive(engine, method)
        elif self.case.backend == "nccl":  # one tensor at a time, from the broadcast
            for name in args[0]["names"]:
                self._survive(engine, method)
                self._took(engine, [(name, self._communicator.receive(engine))])
        else:
            self._survive(engine, method)
            self._took(engine, self._read(engine, args[0]))

    def _survive(self, engine: int, method: str) -> None:
        """Rollout rank 1 dies (or stalls) here at the case's point (or died already)."""
        case = self.case
        if engine == 1 and method == case.method:
            self.dead = self.dead or method != "update_weights" or self.taken == case.taken_before
        if engine == 1 and self.dead and case.stalls:
            self.released.wait()  # alive, never done: until the case is closed
        if engine == 1 and self.dead:
            raise EngineLost(f"rollout rank 1 on pool rollout died in {method}")

    def _took(self, engine: int, tensors: list[tuple[str, Tensor]]) -> None:
        if engine == 0:
            self.loaded.update((name, tensor.clone()) for name, tensor in tensors)
        else:
            self.taken += 1

    def _read(self, engine: int, info: dict[str, Any]) -> list[tuple[str, Tensor]]:
        if self.case.backend == "ipc":  # each engine opens the handle of its own GPU
            handles = zip(info["names"], info["ipc_handles"], strict=True)
            return [(name, handle[STAND_IN_GPU]) for name, handle in handles]
        return self.segments[engine].read(Bucket.from_dict(info))

    @property
    def _communicator(self) -> StandInCommunicator:
        assert self.communicator is not None
        return self.communicator

    def close(self) -> None:
        self.released.set()
        if self.communicator is not None:
            self.communicator.release_receivers()  # an engine left in a receive
        for thread in self.threads:
            thread.shutdown(wait=True)
        for segments in self.segments:
            segments.close()


class NoEngines(EngineFanOut):
    """The client of the actor's other ranks: only rank 0 drives the engines."""

    def submit(self, method: str, *args: Any) -> Any:
        raise AssertionError(f"{method} from an actor rank other than 0")


@contextlib.contextmanager
def stand_ins(case: Case, rank: int, communicator: StandInCommunicator | None) -> Iterator[None]:
    """What a GPU would give the case's backend (module docstring)."""
    with contextlib.ExitStack() as stack:
        if case.backend == "nccl":
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            opens = partial(open_nccl_sender, communicator=communicator)
            stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda: None))
            stack.enter_context(
                mock.patch.object(WeightTransferTrainerFactory, "trainer_init", opens)
            )
        if case.backend == "ipc":
            from vllm.distributed.weight_transfer import ipc_engine

            from rlhf_trainer.rollout import transfer_engines

            gpu = SimpleNamespace(uuid=f"GPU-stand-in-{rank}")
            for target, name, value in [
                (transfer_engines, "IPC_PACKED", False),  # packing needs CUDA streams
                (torch.accelerator, "current_device_index", lambda: 0),
                (torch.cuda, "get_device_properties", lambda index: gpu),
                (torch.cuda, "synchronize", lambda: None),
                (torch.cuda, "ipc_collect", lambda: None),
                (ipc_engine, "reduce_tensor", lambda tensor: (None, tensor.clone())),
            ]:
                stack.enter_context(mock.patch.object(target, name, value))
        yield


def open_nccl_sender(
    info: Any, *, client: Any, source: Any, communicator: StandInCommunicator | None
) -> Any:
    """vLLM's NCCL sender as its `trainer_init` makes it, on the stand-in communicator in
    place of the PyNccl group that its rendezvous would open. Unpacked: vLLM's packed
    broadcast needs CUDA streams."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    sender = NCCLTrainerWeightTransferEngine(
        client=client, source=source, is_sender=info.is_sender, packed=False
    )
    sender.model_update_group = communicator
    return sender


VERSION = 7


def push(case: Case, actor: Actor, expected: dict[str, Tensor]) -> str:
    """One push of the case by this actor rank: "ok", or the error it ended with."""
    rank = actor.info.rank
    communicator = StandInCommunicator(2) if case.backend == "nccl" and rank == 0 else None
    engines = DyingEngines(case, communicator) if rank == 0 else NoEngines()
    setup = TransferSetup("127.0.0.1", 0, 2, (), 1, 60.0, case.backend)
    try:
        with stand_ins(case, rank, communicator):
            actor.open_weight_transfer(setup, engines)
            actor.send_weights(VERSION)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        actor.close()
        if isinstance(engines, DyingEngines):
            engines.close()
    if isinstance(engines, DyingEngines) and not loaded_whole(engines.loaded, expected):
        return "rollout rank 0 loaded other weights than the policy's"
    return "ok"


def loaded_whole(loaded: dict[str, Tensor], expected: dict[str, Tensor]) -> bool:
    return loaded.keys() == expected.keys() and all(
        torch.equal(loaded[name], tensor) for name, tensor in expected.items()
    )


def push_cases(rank: int, job: JobConfig, cases: list[Case]) -> list[str]:
    """Every case's outcome on this actor rank, in order; stops at a case that broke the
    actor's group (a rank waited past its timeout), since later ones cannot mean much."""
    dist.distributed_c10d._set_pg_timeout(GROUP_TIMEOUT)
    actor = Actor(RankInfo(Role.ACTOR, "policy", rank, dist.get_world_size()), job)
    expected = dict(PolicySource(actor.model, actor.tied, actor.engine_dtype))  # gathers
    outcomes = []
    for case in cases:
        outcomes.append(push(case, actor, expected))
        if outcomes[-1].startswith("DistBackendError"):
            break
    return outcomes
