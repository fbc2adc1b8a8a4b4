"""Waiting with a deadline, and naming who did not answer.

A rank stopped or hung in a collective (a weight transfer, say) leaves its peers
waiting in the same collective: from the driver, all of them just have not answered.
So when a wait runs out, each rank still in its call is asked a trivial question on a
thread of its own (the TELEMETRY concurrency group, which answers beside a call in
progress). A rank that answers is alive and waiting for the others; one that does not
is the one to name.

Every call a worker group issues is recorded here by its future's id (not the future
itself, which would keep its result alive in Ray's object store), so that a wait on
any mix of futures can say whose they are.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ray import ObjectRef

TELEMETRY = "telemetry"  # the concurrency group of calls that must not wait for a call
PROBE_S = 10.0  # a live rank answers at once, busy or not
# Silent this long, a rank is taken for lost (stopped, or on a node Ray has not yet
# found dead). Less would take a rank starved of CPU on a loaded node for dead; one that
# Ray finds dead (killed, its node lost) is dead at once.
LOST_AFTER_S = 60.0
# A rank that dies in a collective often reaches its peers first, as their collective's
# own error (gloo: "Connection closed by peer"), and Ray finds it dead a moment later:
# a failed call waits this long for a peer's death to name instead.
PEER_DEATH_S = 10.0
TRACKED_CALLS = 10_000  # the oldest are forgotten first (a future nobody waited for)


@dataclass(frozen=True)
class RankCall:
    """One rank's call, as the driver issued it."""

    role: str
    pool: str
    rank: int
    method: str
    host: Any  # the rank's Ray actor handle (RankHost)

    def __str__(self) -> str:
        return f"{self.role} rank {self.rank} on pool {self.pool} ({self.method})"


class NoAnswer(TimeoutError):
    """A wait ran out; the message names each rank still in its call and what it is."""


class RankDied(RuntimeError):
    """A rank's process ended during its call (killed, out of memory, its node lost);
    the message names the rank, its pool and the call."""


class RankOutOfMemory(RankDied):
    """A rank's call ended for lack of memory: Ray's memory monitor killed its process
    (the node's memory), or the call ran out of a GPU's or the host's memory. The
    message names the rank, its pool, the call and the figure."""


class RanksLost(RankDied):
    """Ranks found dead while nobody was waiting on a call of theirs: `ranks` (their
    own), of `role` on `pool`."""

    def __init__(self, role: str, pool: str, ranks: Sequence[int]) -> None:
        self.role, self.pool, self.ranks = role, pool, tuple(ranks)
        names = ", ".join(f"{role} rank {rank} on pool {pool}" for rank in self.ranks)
        super().__init__(f"{names} lost (killed, its node lost, or silent {LOST_AFTER_S:g} s)")


_issued: OrderedDict[bytes, RankCall] = OrderedDict()


def record(ref: ObjectRef[Any], call: RankCall) -> None:
    _issued[ref.binary()] = call
    while len(_issued) > TRACKED_CALLS:
        _issued.popitem(last=False)


def forget(refs: Sequence[ObjectRef[Any]]) -> None:
    for ref in refs:
        _issued.pop(ref.binary(), None)


def no_answer(pending: Sequence[ObjectRef[Any]], waited_s: float) -> NoAnswer:
    """The error for a wait of `waited_s` that `pending` did not finish (those that
    have finished meanwhile are left out): the ranks that do not answer at all first
    (stopped, hung, or on a lost node), then the live ones that wait for them."""
    import ray

    unfinished = ray.wait(list(pending), num_returns=len(pending), timeout=0)[1]
    calls = [_issued.get(ref.binary()) for ref in unfinished]
    known = [call for call in calls if call is not None]
    live = answering(known)
    silent = [call for call, up in zip(known, live, strict=True) if not up]
    waiting = [call for call, up in zip(known, live, strict=True) if up]
    parts = [f"no answer within {waited_s:g} s"]
    if silent:
        parts.append("not answering (stopped, hung, dead or lost): " + "; ".join(map(str, silent)))
    if waiting:
        parts.append("alive, still waiting in their call: " + "; ".join(map(str, waiting)))
    if len(known) < len(calls):
        parts.append(f"{len(calls) - len(known)} other call(s) not finished")
    return NoAnswer(". ".join(parts))


def rank_died(ref: ObjectRef[Any], error: Exception) -> RankDied:
    """The error for a call whose rank's process died or ran out of memory: who it was,
    and why, in a line (`out_of_memory`, `death_reason`)."""
    call = _issued.get(ref.binary())
    who = str(call) if call is not None else "a rank (a call not issued by a worker group)"
    if (shortage := out_of_memory(error)) is not None:
        return RankOutOfMemory(f"{who} ran out of memory: {shortage}")
    return RankDied(f"{who} died: {death_reason(error)}")


# Ray's memory monitor, when it kills a worker (ray.exceptions.OutOfMemoryError, Ray 2.60):
# "... Memory on the node (IP: 10.0.0.5, ID: ...) was 9.23GB used / 23.54GB limit (0.39)"
RAY_NODE_MEMORY = re.compile(r"Memory on the node \(IP: ([^,]+),[^)]*\) was ([^(\n]+?) \(")
# torch's allocators: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total
# capacity of 79.19 GiB of which 1.06 GiB is free. ..." and, on CPU,
# "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes. ..."
TORCH_OUT_OF_MEMORY = re.compile(
    r"(CUDA out of memory\..*? is free\.|can't allocate memory: [^.]*)"
)
# Ray's word for a worker that ended without a goodbye (a SIGKILL or a crash).
RAY_EXIT_DETAIL = re.compile(r"Worker exit detail: ([^.]*)")


def out_of_memory(error: BaseException) -> str | None:
    """What ran out and the figure, if `error` says the rank ran out of memory: Ray's
    memory monitor killed its process (the node's memory, used / limit), or its call
    raised torch's out of memory (a GPU's, or the host's); None otherwise."""
    import ray

    cause = getattr(error, "cause", None)  # a RayTaskError's: what the call raised
    if isinstance(error, ray.exceptions.OutOfMemoryError):
        found = RAY_NODE_MEMORY.search(str(error))
        figure = f"{found[2]} on node {found[1]}" if found else _first_line(error)
        return f"Ray's memory monitor killed its process ({figure})"
    if isinstance(cause, torch.OutOfMemoryError) or (
        isinstance(cause, RuntimeError) and "can't allocate memory" in str(cause)
    ):
        found = TORCH_OUT_OF_MEMORY.search(str(cause))
        return found[0] if found else _first_line(cause)
    return None


def death_reason(error: BaseException) -> str:
    """Ray's reason for a rank's death, in a line. Of a process that ended without a word
    to Ray (a signal, a crash, an exit) Ray cannot tell why; the kernel's OOM killer is
    the usual cause, and only the node's kernel log says (its address is given)."""
    text = str(error)
    if (detail := RAY_EXIT_DETAIL.search(text)) and "connection error" in detail[1]:
        node = re.search(r"\tip: (\S+)", text)
        where = f" on {node[1]}" if node else ""
        return (
            f"its process ended abruptly (killed, crashed or exited; if killed, the "
            f"kernel's OOM killer is the usual cause: see the kernel log{where})"
        )
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def peer_died(pending: Sequence[ObjectRef[Any]], within_s: float = PEER_DEATH_S) -> RankDied | None:
    """RankDied for the first of `pending` whose rank Ray finds dead within `within_s`
    (calls that end otherwise are passed over); None if none does."""
    import ray

    deadline = time.monotonic() + within_s
    waiting = list(pending)
    while waiting and (left := deadline - time.monotonic()) > 0:
        done, waiting = ray.wait(waiting, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as error:
                return rank_died(ref, error)
            except ray.exceptions.RayError:
                pass  # failed on its own: the death looked for is another's
    return None


def answering(calls: Sequence[RankCall], within_s: float = PROBE_S) -> list[bool]:
    """Per call, whether its rank answers a ping within `within_s`. One that Ray finds
    dead is False at once; one that Ray cannot reach for now is asked again."""
    import ray

    deadline = time.monotonic() + within_s
    up = [False] * len(calls)
    pings = {_ping(call): i for i, call in enumerate(calls)}
    while pings and (left := deadline - time.monotonic()) > 0:
        for ping in ray.wait(list(pings), num_returns=1, timeout=left)[0]:
            i = pings.pop(ping)
            try:
                up[i] = ray.get(ping)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                pings[_ping(calls[i])] = i
            except ray.exceptions.RayError:
                pass  # the actor is dead
    return up


def _ping(call: RankCall) -> ObjectRef[bool]:
    ping: ObjectRef[bool] = call.host.alive.options(concurrency_group=TELEMETRY).remote()
    return ping
