"""A work queue of job keys, as controller-runtime has: each key waits in the queue at
most once, and is never processed by two workers at the same time. A key added while
it is being processed is queued again when that processing ends. A key has at most one
delayed add pending: the latest asked for.

Two priorities, as controller-runtime's priority queue has. A new job's key (one whose
RayJob is still to be made) is urgent; every other key (a child's event, a job's report
with its RoleBinding, a retry) waits while urgent keys do, so a burst of new jobs gets its
RayJobs before the API server spends itself on the reports of the jobs already made. Once the oldest
normal key has waited MAX_DEFER_SECONDS, the two lines take turns until it has not: a
long burst neither starves the other jobs nor loses its own order to them at once.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable

Key = tuple[str, str]  # (namespace, name)

MAX_DEFER_SECONDS = 300.0


class WorkQueue:
    def __init__(
        self, max_defer: float = MAX_DEFER_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_defer = max_defer
        self.clock = clock
        # Each waiting key has one live entry, found by its ticket; an entry whose
        # ticket is no longer its key's (the key moved up, or was taken) is skipped.
        self._urgent: deque[tuple[float, int, Key]] = deque()  # (added at, ticket, key)
        self._normal: deque[tuple[float, int, Key]] = deque()
        self._waiting: dict[Key, tuple[int, bool]] = {}  # key -> (ticket, urgent)
        self._tickets = itertools.count()
        self._normal_turn = False  # while a normal key is overdue: whose turn is next
        self._count = asyncio.Semaphore(0)  # one per waiting key
        self._active: set[Key] = set()
        self._again: dict[Key, bool] = {}  # added while active -> urgent
        self._later: dict[Key, asyncio.TimerHandle] = {}

    def add(self, key: Key, urgent: bool = False) -> None:
        if key in self._active:
            self._again[key] = self._again.get(key, False) or urgent
            return
        waiting = self._waiting.get(key)
        if waiting is not None and (waiting[1] or not urgent):
            return  # already waiting, at least as urgent
        ticket = next(self._tickets)
        self._waiting[key] = (ticket, urgent)
        (self._urgent if urgent else self._normal).append((self.clock(), ticket, key))
        if waiting is None:
            self._count.release()

    def add_later(self, key: Key, seconds: float) -> None:
        """Add the key in `seconds`, in place of any add_later of it still pending: the
        latest reconcile knows best when to look again, and a job whose reconciles keep
        failing keeps one retry, at the latest backoff, not one per failure."""
        pending = self._later.pop(key, None)
        if pending is not None:
            pending.cancel()
        self._later[key] = asyncio.get_running_loop().call_later(seconds, self._due, key)

    def _due(self, key: Key) -> None:
        del self._later[key]
        self.add(key)

    async def get(self) -> Key:
        await self._count.acquire()
        key = self._pop()
        del self._waiting[key]
        self._active.add(key)
        return key

    def _pop(self) -> Key:
        """The first urgent key; while the oldest normal one is overdue, turn about."""
        for line in (self._urgent, self._normal):
            while line and self._waiting.get(line[0][2], (None,))[0] != line[0][1]:
                line.popleft()  # a stale entry
        overdue = self._normal and self.clock() - self._normal[0][0] > self.max_defer
        take_normal = not self._urgent or (overdue and self._normal_turn)
        self._normal_turn = bool(overdue) and not take_normal
        return (self._normal if take_normal else self._urgent).popleft()[2]

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._again:
            self.add(key, self._again.pop(key))

    def __len__(self) -> int:
        return len(self._waiting)
