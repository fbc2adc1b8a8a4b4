"""A work queue of job keys, as controller-runtime has: each key waits in the queue at
most once, and is never processed by two workers at the same time. A key added while
it is being processed is queued again when that processing ends. A key has at most one
delayed add pending: the latest asked for."""

from __future__ import annotations

import asyncio

Key = tuple[str, str]  # (namespace, name)


class WorkQueue:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._waiting: set[Key] = set()
        self._active: set[Key] = set()
        self._again: set[Key] = set()
        self._later: dict[Key, asyncio.TimerHandle] = {}

    def add(self, key: Key) -> None:
        if key in self._active:
            self._again.add(key)
        elif key not in self._waiting:
            self._waiting.add(key)
            self._queue.put_nowait(key)

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
        key = await self._queue.get()
        self._waiting.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)

    def __len__(self) -> int:
        return len(self._waiting)
