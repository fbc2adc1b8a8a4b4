"""A deadline for each phase of a weight sync, sized from the bytes it moves.

A sync calls every engine four ways (vLLM's weight-transfer API): `init` (set up, once
per transfer), `start`, one `bucket` per update call, and `finish`. Each phase may take

    min(ceiling, max(floor, SLACK x bytes / rate))

where `rate` is the bytes per second the engines' bucket calls have taken so far (an
assumed rate counts as PRIOR_S of them, before any is measured), `floor` is PHASE_FLOOR_S
(a phase that moves little: a stall is seen in a minute, not at the flat timeout) and
`ceiling` is the job's `trainer.weightSyncTimeoutSeconds`, kept inside the waits of
the actor's and the transfer's collectives (`engine_client.phase_ceiling_s`), so that
the engine calls, which can name the engine, are what report. `finish` is sized from the whole
push (vLLM's layerwise reload finishes every layer there). A phase past its deadline
is a `Stall`: the engines (rank, pool) still in it, the phase, and the bytes moved so
far out of the push's total.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# The least a phase may take (less where the job's timeout is less): setting a transfer
# up, or a start, on a loaded node. A constant: the spec's one knob is the ceiling.
PHASE_FLOOR_S = 60.0
SLACK = 4.0  # a phase may take this many times what its bytes took at the measured rate
ASSUMED_BYTES_PER_S = 100e6  # before a bucket is measured: a slow host link
PRIOR_S = 1.0  # how many seconds of measurement the assumed rate weighs
PHASES = {  # vLLM's engine calls, by the phase of a sync they are
    "init_weight_transfer_engine": "init",
    "start_weight_update": "start",
    "update_weights": "bucket",
    "finish_weight_update": "finish",
}


def phase_deadline_s(
    nbytes: float, bytes_per_s: float, floor_s: float, ceiling_s: float, slack: float = SLACK
) -> float:
    """How long a phase that moves `nbytes` may take at `bytes_per_s`."""
    if bytes_per_s <= 0 or floor_s > ceiling_s:
        raise ValueError(f"need a positive rate and floor <= ceiling, got {bytes_per_s}, "
                         f"{floor_s}, {ceiling_s}")  # fmt: skip
    return min(ceiling_s, max(floor_s, slack * nbytes / bytes_per_s))


def measured_rate(
    samples: list[tuple[float, float]],
    assumed: float = ASSUMED_BYTES_PER_S,
    prior_s: float = PRIOR_S,
) -> float:
    """Bytes per second over the (bytes, seconds) of the buckets measured, with the
    assumed rate counting as `prior_s` seconds of them."""
    moved = assumed * prior_s + sum(nbytes for nbytes, _ in samples)
    return moved / (prior_s + sum(seconds for _, seconds in samples))


def call_bytes(method: str, args: tuple[Any, ...]) -> int:
    """The bytes an engine call moves: an update's tensors (a bucket of ours says its
    size; vLLM's NCCL and IPC updates list names, dtypes and shapes), else none."""
    if method != "update_weights" or not args or not isinstance(args[0], dict):
        return 0
    info = args[0]
    if "nbytes" in info:
        return int(info["nbytes"])
    sizes = zip(info.get("dtype_names", ()), info.get("shapes", ()), strict=False)
    return sum(math.prod(shape) * _itemsize(dtype) for dtype, shape in sizes)


def _itemsize(dtype_name: str) -> int:
    import torch

    dtype = getattr(torch, dtype_name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0


@dataclass(frozen=True)
class Stall:
    """Engines that did not finish a phase of a sync by its deadline."""

    pool: str
    ranks: tuple[int, ...]
    phase: str  # init, start, bucket or finish
    moved: int  # bytes of the push the engines had taken when it stalled
    total: int  # bytes of the whole push (0: not known yet)

    def __str__(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        moved = f"{self.moved} of {self.total} bytes moved"
        return f"rollout rank(s) {ranks} on pool {self.pool} missed the {self.phase} " + (
            f"deadline of a weight sync with {moved}"
        )

    @classmethod
    def found_in(cls, error: BaseException) -> Stall | None:
        """The stall an error reports, wherever it travelled: an actor rank's verdict,
        a Ray task's error, a wrapper's message (they all keep its text)."""
        found = _STALL.search(str(error))
        if found is None:
            return None
        ranks = tuple(int(rank) for rank in found["ranks"].split(", "))
        return cls(found["pool"], ranks, found["phase"], int(found["moved"]), int(found["total"]))


_STALL = re.compile(
    r"rollout rank\(s\) (?P<ranks>\d+(?:, \d+)*) on pool (?P<pool>\S+) missed the "
    r"(?P<phase>\w+) deadline of a weight sync with (?P<moved>\d+) of (?P<total>\d+) bytes"
)


class SyncClock:
    """One sender's deadlines: the rate its engines' buckets were measured at, and the
    push in progress (bytes moved of its total). Calls are answered in the order sent,
    so a call's phase begins when it was sent or when the one before was answered."""

    def __init__(self, ceiling_s: float, floor_s: float = PHASE_FLOOR_S) -> None:
        self.floor_s, self.ceiling_s = min(floor_s, ceiling_s), ceiling_s
        self.samples: list[tuple[float, float]] = []  # (bytes, seconds) of buckets
        self.moved = 0
        self.total = 0
        self.last_answer = -math.inf

    def sent(self, method: str, args: tuple[Any, ...], push_bytes: int) -> int:
        """A call sent to the engines: the bytes it moves. A push begins at its start
        (`push_bytes`: its total, where the sender knows it; our buckets say it too)."""
        if method == "start_weight_update":
            self.moved, self.total = 0, push_bytes
        if method == "update_weights" and args and isinstance(args[0], dict):
            self.total = max(self.total, int(args[0].get("model_bytes", 0)))
        return call_bytes(method, args)

    def begins(self, sent_at: float) -> float:
        return max(sent_at, self.last_answer)

    def deadline_s(self, method: str, nbytes: int) -> float:
        moving = self.total if PHASES.get(method) == "finish" else nbytes
        return phase_deadline_s(moving, measured_rate(self.samples), self.floor_s,
                                self.ceiling_s)  # fmt: skip

    def answered(self, method: str, nbytes: int, began: float, now: float) -> None:
        self.last_answer = now
        if nbytes > 0:
            self.samples = [*self.samples[-63:], (nbytes, max(now - began, 1e-6))]
            self.moved += nbytes
            self.total = max(self.total, self.moved)

    def stall(self, pool: str, ranks: list[int], method: str) -> Stall:
        return Stall(pool, tuple(ranks), PHASES.get(method, method), self.moved, self.total)
