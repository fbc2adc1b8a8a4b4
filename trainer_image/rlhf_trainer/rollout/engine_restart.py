"""A rollout engine that dies is restarted in place, up to `generation.maxEngineRestarts`.

Death is seen from the engine's side of the process boundary: a request or a call
fails with vLLM's `EngineDeadError`, or vLLM reports itself errored (its engine-core
process exited: vLLM watches it). vLLM then fails every request in flight at once, so
many callers see one death together. `EngineRecovery` turns those into one restart:
the first caller starts it, the others wait for it, and all of them then run again on
the new engine (`RolloutEngine._alive`). A caller that saw an engine which has been
replaced since does not restart the new one.

The restart happens inside the rollout worker's process (its Ray actor): the same
placement-group bundle, the same GPUs, the same relay of the weight transfer (which
belongs to this process, not to vLLM's engine core). Only vLLM's own engine is rebuilt;
it gets the weights this process keeps (`engine.RolloutEngine._restart`).

Everything here runs on the engine's event loop, one coroutine at a time, so the
bookkeeping needs no lock. vLLM is imported only where an engine exists (`engine_died`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.5  # how often a call waiting on vLLM checks that its engine is still alive


class EngineDied(RuntimeError):
    """The engine died while a call waited on it."""


class EngineRestartsExhausted(RuntimeError):
    """The engine died once more than `generation.maxEngineRestarts` allows."""


class EngineRecovery:
    """One engine's restarts: at most one at a time, however many callers saw it die,
    and at most `limit` in all; the next death after that is an error naming `name`.

    `restart` rebuilds the engine (it must leave a working engine with the current
    weights, or raise); `policy_version` says which weights that is, for the log.
    `unrestartable`: why this engine can never be restarted, whatever `limit` says (its
    weights never pass through this process); its first death is then the error.
    """

    def __init__(
        self,
        name: str,
        limit: int,
        restart: Callable[[], Awaitable[None]],
        policy_version: Callable[[], int],
        unrestartable: str | None = None,
    ) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.name = name
        self.limit = 0 if unrestartable else limit
        self.unrestartable = unrestartable
        self.restarts = 0  # started, including one under way
        self.generation = 0  # which engine is up: +1 with every finished restart
        self.seconds: list[float] = []  # how long each finished restart took
        self._restart = restart
        self._policy_version = policy_version
        self._underway: asyncio.Task[None] | None = None

    async def settled(self) -> None:
        """Wait for a restart under way, if any (raising what it raised)."""
        if self._underway is not None:
            await asyncio.shield(self._underway)

    async def recover(self, error: BaseException, generation: int) -> None:
        """`error`: how a caller saw engine number `generation` die. Returns once a newer
        engine is up (the caller then runs again on it); raises EngineRestartsExhausted
        past the limit, or whatever the restart raised."""
        if generation < self.generation:
            return  # replaced already: this caller saw the old engine die
        if self._underway is None:
            if self.restarts >= self.limit:
                why = self.unrestartable or (
                    f"after {self.restarts} restart(s); generation.maxEngineRestarts is "
                    f"{self.limit}"
                )
                raise EngineRestartsExhausted(
                    f"{self.name}: vLLM engine died ({error!r}); {why}"
                ) from error
            self.restarts += 1
            log.warning(
                "%s: vLLM engine died (%r); restart %d of %d, reloading policy version %d",
                self.name,
                error,
                self.restarts,
                self.limit,
                self._policy_version(),
            )
            self._underway = asyncio.ensure_future(self._run())
        await asyncio.shield(self._underway)

    async def _run(self) -> None:
        started = time.perf_counter()
        try:
            await self._restart()
        except BaseException:
            log.exception("%s: the restart of its vLLM engine failed", self.name)
            raise
        finally:
            self._underway = None
        self.generation += 1
        self.seconds.append(time.perf_counter() - started)
        log.warning(
            "%s: vLLM engine restarted in %.1f s with policy version %d",
            self.name,
            self.seconds[-1],
            self._policy_version(),
        )


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


def shut_down_quietly(llm: Any) -> None:
    """Release what is left of a dead engine (its sockets, its metrics' process)."""
    try:
        llm.shutdown()
    except Exception:
        log.warning("shutting down a dead vLLM engine failed; going on", exc_info=True)
