"""The live sessions of one environment class, and every call into them (server.py
serves them over HTTP).

A server that heals rather than wedges:
- each call into the class (its constructor, reset, step, score) has a deadline,
  `call_seconds`. Past it the answer is a 504 and the session ends: its turn lock is let
  go. An async method is cancelled; a sync one runs in the host's own thread pool, and
  a thread cannot be stopped, so it runs on, counted as `abandoned` until it returns;
- `liveness()` (GET /livez) fails once abandoned calls hold every thread of the pool, or
  the pool runs nothing within LIVENESS_SECONDS, so the kubelet restarts the pod;
- a session that no call has used for `idle_seconds` expires: its `close` runs (a
  trainer that died never closes its sessions);
- at most `max_sessions` at once: past it, a 503, and the trainer starts the session on
  another replica.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from fastapi import HTTPException
from pydantic import BaseModel, ValidationError

from rlhf_env.protocol import Scored, Start, Started, Step, describe

log = logging.getLogger(__name__)

Result = TypeVar("Result", bound=BaseModel)

DEFAULT_CALL_SECONDS = 300.0  # a cluster's server gets the job's own (the operator's render)
DEFAULT_IDLE_SECONDS = 1800.0  # multiTurn.episodeTimeoutSeconds' default
THREADS = 32  # at least: a pool of max(THREADS, max_sessions), one call per session at once
LIVENESS_SECONDS = 5.0  # the pool runs a no-op within this, or the server is not live


@dataclass(frozen=True)
class HostLimits:
    """How a server bounds its sessions (None: no bound)."""

    max_sessions: int | None = None
    call_seconds: float | None = DEFAULT_CALL_SECONDS
    idle_seconds: float | None = DEFAULT_IDLE_SECONDS
    threads: int | None = None  # None: max(THREADS, max_sessions)

    @property
    def pool_size(self) -> int:
        return self.threads or max(THREADS, self.max_sessions or 0)


@dataclass(eq=False)
class Session:
    id: str
    used: float  # when its last call ended (the host's clock)
    environment: Any = None  # the user's instance; None while it is being constructed
    held: bool = False  # a call past its deadline still runs in a thread: no more calls
    # One call at a time per session: the user's class need not be thread-safe.
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)


class CallTimedOut(Exception):
    """A call past its deadline; `running`: its thread still runs it."""

    def __init__(self, running: bool) -> None:
        self.running = running


def explain(error: Exception) -> str:
    text = describe(error) if isinstance(error, ValidationError) else str(error)
    return f"{type(error).__name__}: {text}"


class SessionHost:
    """The live sessions of one environment class, and every call into them.

    The sessions live in a plain dict without a lock: all of this runs on the server's one
    event loop, and each check-then-change of the dict has no `await` inside it, so two
    requests cannot interleave there. Only the user's sync methods leave the loop (the
    host's threads).
    """

    def __init__(
        self,
        environment_cls: type[Any],
        limits: HostLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.environment_cls = environment_cls
        self.name = environment_cls.__qualname__
        self.limits = limits or HostLimits()
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.threads = ThreadPoolExecutor(self.limits.pool_size, thread_name_prefix="session")
        self.abandoned = 0  # calls past their deadline whose thread still runs them

    async def start(self, row: dict[str, Any]) -> Started:
        session = await self._open()
        log.debug("session %s row: %r", session.id, row)
        async with session.turn:
            start = await self._call(session, "reset", Start, row)
        return Started(session=session.id, messages=start.messages, tools=start.tools)

    async def step(self, session_id: str, message: Any) -> Step:
        session = self._get(session_id)
        async with session.turn:
            return await self._call(session, "step", Step, message)

    async def score(self, session_id: str) -> Scored:
        session = self._get(session_id)
        async with session.turn:
            return await self._call(session, "score", Scored, wrap="score")

    async def close(self, session_id: str) -> None:
        session = self._get(session_id)
        self.sessions.pop(session.id, None)  # from now on its id is unknown (404)
        async with session.turn:  # a call still running finishes first (or times out)
            problem = await self._end(session, "closed")
        if problem:
            raise HTTPException(500, problem)

    async def close_all(self) -> None:
        """At shutdown: every session's `close` runs."""
        for session in list(self.sessions.values()):
            self.sessions.pop(session.id, None)
            await self._end(session, "closed at shutdown")
        self.threads.shutdown(wait=False, cancel_futures=True)

    async def expire_idle(self) -> int:
        """End the sessions no call has used for idle_seconds (their `close` runs); how
        many. A session with a call running is not idle."""
        idle = self.limits.idle_seconds
        if idle is None:
            return 0
        now = self.clock()
        expired = [
            s
            for s in self.sessions.values()
            if s.environment is not None and not s.turn.locked() and now - s.used >= idle
        ]
        for session in expired:
            self.sessions.pop(session.id, None)
        for session in expired:
            async with session.turn:
                problem = await self._end(session, f"expired after {idle:g} s idle")
            if problem:
                log.warning("session %s: %s", session.id, problem)
        return len(expired)

    async def keep_expiring(self) -> None:
        """expire_idle, for ever, often enough that a session outlives its TTL by at most
        a tenth of it (at most 30 s more)."""
        if self.limits.idle_seconds is None:
            return
        while True:
            await asyncio.sleep(min(self.limits.idle_seconds / 10, 30.0))
            try:
                await self.expire_idle()
            except Exception:  # the next round tries again; the server goes on
                log.exception("expiring idle sessions failed")

    async def liveness(self, probe_seconds: float = LIVENESS_SECONDS) -> str | None:
        """Why this server should be restarted, or None: its threads are all held by
        calls past their deadline, or its pool runs nothing within probe_seconds."""
        threads = self.limits.pool_size
        if self.abandoned >= threads:
            return f"calls past the call deadline hold all {threads} threads"
        try:
            async with asyncio.timeout(probe_seconds):
                await asyncio.wrap_future(self.threads.submit(lambda: None))
        except TimeoutError:
            return (
                f"the thread pool ran nothing within {probe_seconds:g} s ({self.abandoned} "
                f"of its {threads} threads held by calls past the call deadline)"
            )
        return None

    async def _open(self) -> Session:
        limit = self.limits.max_sessions
        if limit is not None and len(self.sessions) >= limit:
            raise HTTPException(
                503, f"{len(self.sessions)} sessions are open, the most this server holds"
            )
        session = Session(id=uuid.uuid4().hex, used=self.clock())
        self.sessions[session.id] = session  # counts against the limit while it starts
        try:
            session.environment = await self._run(self.environment_cls)
        except CallTimedOut as late:
            self.sessions.pop(session.id, None)
            raise HTTPException(504, self._late(f"{self.name}()", late)) from None
        except Exception as error:
            self.sessions.pop(session.id, None)
            raise HTTPException(500, f"{self.name}() raised {explain(error)}") from error
        log.info("session %s started (%d live)", session.id, len(self.sessions))
        return session

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.environment is None:
            raise HTTPException(
                404,
                f"no session {session_id!r}: it was closed, it failed, it expired, or it "
                "never existed",
            )
        return session

    async def _call(
        self, session: Session, method: str, result: type[Result], *args: Any, wrap: str = ""
    ) -> Result:
        """The user's method, its return validated as `result` (under a field `wrap`, if
        given); any failure ends the session. The caller holds the session's turn."""
        called = f"{self.name}.{method}"
        try:
            returned = await self._run(getattr(session.environment, method), *args)
        except CallTimedOut as late:
            await self._fail(session, method, close=not late.running)
            raise HTTPException(504, self._late(called, late)) from None
        except Exception as error:
            await self._fail(session, method)
            raise HTTPException(500, f"{called} raised {explain(error)}") from error
        finally:
            session.used = self.clock()
        try:
            return result.model_validate({wrap: returned} if wrap else returned)
        except ValidationError as error:
            await self._fail(session, method)
            raise HTTPException(
                500, f"{called} returned an invalid {result.__name__}: {describe(error)}"
            ) from error

    def _late(self, called: str, late: CallTimedOut) -> str:
        still = "; its thread still runs it" if late.running else ""
        return (
            f"{called} ran past the server's {self.limits.call_seconds:g} s deadline "
            f"(--call-seconds){still}; the session ends"
        )

    async def _run(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` under the call deadline: a coroutine function on the loop,
        anything else in the host's threads. CallTimedOut past the deadline."""
        if inspect.iscoroutinefunction(function):
            try:
                async with asyncio.timeout(self.limits.call_seconds):
                    return await function(*args)
            except TimeoutError:
                raise CallTimedOut(running=False) from None
        running = self.threads.submit(partial(function, *args))
        try:
            async with asyncio.timeout(self.limits.call_seconds):
                result = await asyncio.wrap_future(running)  # cancelled: running.cancel()
                return await result if inspect.isawaitable(result) else result
        except TimeoutError:
            if running.cancel():  # it never started: no thread holds it
                raise CallTimedOut(running=False) from None
            self._abandon(running)
            raise CallTimedOut(running=not running.done()) from None

    def _abandon(self, running: Future[Any]) -> None:
        """Count `running` as abandoned until its thread returns."""
        if running.done():
            return
        self.abandoned += 1
        loop = asyncio.get_running_loop()

        def returned(_: Future[Any]) -> None:
            loop.call_soon_threadsafe(self._returned)

        running.add_done_callback(returned)

    def _returned(self) -> None:
        self.abandoned -= 1
        log.info("an abandoned call returned (%d still run)", self.abandoned)

    async def _fail(self, session: Session, method: str, close: bool = True) -> None:
        self.sessions.pop(session.id, None)
        if not close:  # its instance is still in a thread's hands: no second call into it
            session.held = True
            log.warning("session %s dropped after %s ran past its deadline", session.id, method)
            return
        problem = await self._end(session, f"failed in {method}")
        if problem:
            log.warning("session %s: %s", session.id, problem)

    async def _end(self, session: Session, how: str) -> str | None:
        """Run the class's `close`, if it has one; what went wrong there, if anything."""
        log.info("session %s %s (%d live)", session.id, how, len(self.sessions))
        close = getattr(session.environment, "close", None)
        if not callable(close) or session.held:
            return None
        try:
            await self._run(close)
        except CallTimedOut:
            return f"{self.name}.close ran past the {self.limits.call_seconds:g} s deadline"
        except Exception as error:
            return f"{self.name}.close raised {explain(error)}"
        return None
