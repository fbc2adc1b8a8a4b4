"""A STAND-IN for vLLM's `PyNcclCommunicator` on the sender, as far as a broadcast goes
(NCCL cannot run here, and a gloo collective cannot stand in: measured with torch 2.13,
`ProcessGroupGloo.abort()` and `shutdown()` from another thread leave a waiting
broadcast to its own timeout).

A broadcast waits until every engine has taken the tensor (`receive`), and `destroy`
(which is ncclCommAbort in PyNccl) ends a waiting broadcast, after which broadcasts do
nothing, as PyNccl's do once it is disabled. NCCL would wait for ever for an engine
that never takes a tensor; the stand-in raises TimeoutError after STAND_IN_WAIT_S
instead (`wait_s`), so that a missing abort fails a test rather than hanging it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

STAND_IN_WAIT_S = 30.0  # NCCL waits for ever; the stand-in says so after this long


class EngineLost(RuntimeError):
    pass


class StandInCommunicator:
    """vLLM's PyNcclCommunicator on the sender, as far as the broadcast goes (above)."""

    def __init__(self, engines: int, wait_s: float = STAND_IN_WAIT_S) -> None:
        self.wait_s = wait_s
        self.inboxes: list[queue.Queue[torch.Tensor | None]] = [
            queue.Queue() for _ in range(engines)
        ]
        self.taken = threading.Semaphore(0)
        self.aborted = threading.Event()
        self.sent = 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if self.aborted.is_set():
            return  # PyNccl's broadcast once destroyed
        for inbox in self.inboxes:
            inbox.put(tensor.clone())
        deadline = time.monotonic() + self.wait_s
        for _ in self.inboxes:  # every peer takes it, or the sender waits
            while not self.taken.acquire(timeout=0.05):
                if self.aborted.is_set():
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError("the broadcast would wait for ever (NCCL): no abort came")
        self.sent += 1

    def receive(self, engine: int) -> torch.Tensor:
        tensor = self.inboxes[engine].get()
        if tensor is None:
            raise EngineLost("the transfer was torn down under this engine")
        self.taken.release()
        return tensor

    def destroy(self) -> None:
        self.aborted.set()

    def release_receivers(self) -> None:
        """End every engine's wait (in a real cluster: its own abort, or its process)."""
        for inbox in self.inboxes:
            inbox.put(None)
