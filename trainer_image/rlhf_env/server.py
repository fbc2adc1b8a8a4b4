"""The server: one environment class behind the protocol (protocol.py), on FastAPI.

`app_for(Lookup)` is an ASGI app; `python -m rlhf_env serve module:Class` runs one with
uvicorn. Each session is an instance of the class. When the class's code raises, the
answer is a 500 naming the class, the method and the error, and the session ends there
(its `close` runs): a failed episode is not resumed, and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ValidationError

from rlhf_env.environment import call_method
from rlhf_env.protocol import (
    Health,
    Message,
    Scored,
    Start,
    Started,
    StartRequest,
    Step,
    StepRequest,
    describe,
)

log = logging.getLogger(__name__)

Result = TypeVar("Result", bound=BaseModel)


@dataclass(eq=False)
class Session:
    id: str
    environment: Any = None  # the user's instance; None while it is being constructed
    # One call at a time per session: the user's class need not be thread-safe.
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)


def explain(error: Exception) -> str:
    text = describe(error) if isinstance(error, ValidationError) else str(error)
    return f"{type(error).__name__}: {text}"


class SessionHost:
    """The live sessions of one environment class, and every call into them.

    The sessions live in a plain dict without a lock: all of this runs on the server's one
    event loop, and each check-then-change of the dict has no `await` inside it, so two
    requests cannot interleave there. Only the user's methods leave the loop (threads).
    """

    def __init__(self, environment_cls: type[Any], max_sessions: int | None = None) -> None:
        self.environment_cls = environment_cls
        self.name = environment_cls.__qualname__
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}

    async def start(self, row: dict[str, Any]) -> Started:
        session = await self._open()
        log.debug("session %s row: %r", session.id, row)
        async with session.turn:
            start = await self._call(session, "reset", Start, row)
        return Started(session=session.id, messages=start.messages, tools=start.tools)

    async def step(self, session_id: str, message: Message) -> Step:
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
        async with session.turn:  # a call still running finishes first
            problem = await self._end(session, "closed")
        if problem:
            raise HTTPException(500, problem)

    async def close_all(self) -> None:
        """At shutdown: every session's `close` runs."""
        for session in list(self.sessions.values()):
            self.sessions.pop(session.id, None)
            await self._end(session, "closed at shutdown")

    async def _open(self) -> Session:
        if self.max_sessions is not None and len(self.sessions) >= self.max_sessions:
            raise HTTPException(
                503, f"{len(self.sessions)} sessions are open, the most this server holds"
            )
        session = Session(id=uuid.uuid4().hex)
        self.sessions[session.id] = session  # counts against the limit while it starts
        try:
            session.environment = await asyncio.to_thread(self.environment_cls)
        except Exception as error:
            self.sessions.pop(session.id, None)
            raise HTTPException(500, f"{self.name}() raised {explain(error)}") from error
        log.info("session %s started (%d live)", session.id, len(self.sessions))
        return session

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.environment is None:
            raise HTTPException(
                404, f"no session {session_id!r}: it was closed, it failed, or it never existed"
            )
        return session

    async def _call(
        self, session: Session, method: str, result: type[Result], *args: Any, wrap: str = ""
    ) -> Result:
        """The user's method, its return validated as `result` (under a field `wrap`, if
        given); any failure ends the session. The caller holds the session's turn."""
        try:
            returned = await call_method(session.environment, method, *args)
        except Exception as error:
            await self._fail(session, method)
            raise HTTPException(500, f"{self.name}.{method} raised {explain(error)}") from error
        try:
            return result.model_validate({wrap: returned} if wrap else returned)
        except ValidationError as error:
            await self._fail(session, method)
            raise HTTPException(
                500,
                f"{self.name}.{method} returned an invalid {result.__name__}: {describe(error)}",
            ) from error

    async def _fail(self, session: Session, method: str) -> None:
        self.sessions.pop(session.id, None)
        problem = await self._end(session, f"failed in {method}")
        if problem:
            log.warning("session %s: %s", session.id, problem)

    async def _end(self, session: Session, how: str) -> str | None:
        """Run the class's `close`, if it has one; what went wrong there, if anything."""
        log.info("session %s %s (%d live)", session.id, how, len(self.sessions))
        if not callable(getattr(session.environment, "close", None)):
            return None
        try:
            await call_method(session.environment, "close")
        except Exception as error:
            return f"{self.name}.close raised {explain(error)}"
        return None


def app_for(environment_cls: type[Any], *, max_sessions: int | None = None) -> FastAPI:
    """An ASGI app serving `environment_cls` over the protocol: one instance a session,
    at most `max_sessions` at once (503 past it; None: no limit)."""
    host = SessionHost(environment_cls, max_sessions)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await host.close_all()

    app = FastAPI(title=f"{host.name} environment", lifespan=lifespan)
    app.state.host = host

    @app.post("/sessions")
    async def start(request: StartRequest) -> Started:
        return await host.start(request.row)

    @app.post("/sessions/{session}/step")
    async def step(session: str, request: StepRequest) -> Step:
        return await host.step(session, request.message)

    @app.post("/sessions/{session}/score")
    async def score(session: str) -> Scored:
        return await host.score(session)

    @app.delete("/sessions/{session}", status_code=204)
    async def close(session: str) -> None:
        await host.close(session)

    @app.get("/healthz")
    async def healthz() -> Health:
        return Health(environment=host.name, sessions=len(host.sessions))

    return app
