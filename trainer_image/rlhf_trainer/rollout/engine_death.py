"""How a rollout engine's death is seen, and what it means.

Death is seen from the engine's side of the process boundary: a request or a call
fails with vLLM's `EngineDeadError`, or vLLM reports itself errored (its engine-core
process exited: vLLM watches it). vLLM then fails every request in flight at once.

An engine is never rebuilt in place. Its rollout rank's process ends
(`rollout.worker.end_rank`), so that the driver sees a rank lost, as it sees one whose
node is gone, and replaces it in its bundle: a new engine, given the current weights by
the actor's next push through the same weight transfer, on every backend
(`loop.membership`, in both modes).

vLLM is imported only where an engine exists (`engine_died`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.5  # how often a call waiting on vLLM checks that its engine is still alive


class EngineDied(RuntimeError):
    """The engine died while a call waited on it, or before it."""


async def until_dead(awaitable: Awaitable[T], errored: Callable[[], bool]) -> T:
    """Await `awaitable`, unless the engine dies first (`errored()`): then EngineDied.

    vLLM fails the requests of a dead engine, but a utility call in flight (pause,
    resume, a weight load) would wait forever for an answer that never comes.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if errored():
                raise EngineDied("the engine died while a call waited on it")
    finally:
        task.cancel()  # no-op once done


def engine_died(error: Exception, llm: Any) -> bool:
    """Whether `error` means that the engine died: vLLM says so, or says it is errored."""
    from vllm.v1.engine.exceptions import EngineDeadError  # only once there is an engine

    return isinstance(error, EngineDied | EngineDeadError) or bool(llm.errored)


async def utility(llm: Any, call: Awaitable[T]) -> T:
    """A utility call to vLLM's engine core, given up if the engine dies meanwhile."""
    return await until_dead(call, lambda: bool(llm.errored))
