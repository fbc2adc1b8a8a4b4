"""A work queue of job keys, as controller-runtime has: each key waits in the queue at
most once, and is never processed by two workers at the same time. A key added while
it is being processed is queued again when that processing ends."""

from __future__ import annotations

import asyncio

Key = tuple[str, str]  # (namespace, name)


class WorkQueue:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._waiting: set[Key] = set()
        self._active: set[Key] = set()
        self._again: set[Key] = set()

    def add(self, key: Key) -> None:
        if key in self._active:
            self._again.add(key)
        elif key not in self._waiting:
            self._waiting.add(key)
            self._queue.put_nowait(key)

    def add_later(self, key: Key, seconds: float) -> None:
        asyncio.get_running_loop().call_later(seconds, self.add, key)

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
