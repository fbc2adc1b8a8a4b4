"""The server: one environment class behind the protocol (protocol.py), on FastAPI.

`app_for(Lookup)` is an ASGI app; `python -m rlhf_env serve module:Class` runs one with
uvicorn. Each session is an instance of the class (sessions.py holds them). When the
class's code raises, the answer is a 500 naming the class, the method and the error, and
the session ends there (its `close` runs): a failed episode is not resumed, and nothing
is left behind. A call past the server's deadline is a 504, and ends its session too.

GET /healthz says the class is loaded and the loop answers (readiness); GET /livez also
runs a no-op through the threads that run the class's calls, and is a 503 when calls
past their deadline hold them all (liveness: the kubelet restarts the pod).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI, HTTPException

from rlhf_env.protocol import Health, Scored, Started, StartRequest, Step, StepRequest
from rlhf_env.sessions import (
    DEFAULT_CALL_SECONDS,
    DEFAULT_IDLE_SECONDS,
    HostLimits,
    SessionHost,
)


def app_for(
    environment_cls: type[Any],
    *,
    max_sessions: int | None = None,
    call_seconds: float | None = DEFAULT_CALL_SECONDS,
    idle_seconds: float | None = DEFAULT_IDLE_SECONDS,
    threads: int | None = None,
) -> FastAPI:
    """An ASGI app serving `environment_cls` over the protocol: one instance a session, at
    most `max_sessions` at once (503 past it), each call ended (504) past `call_seconds`,
    each session ended once idle for `idle_seconds` (None: no bound); its sync methods
    run in `threads` threads (None: max(THREADS, max_sessions))."""
    limits = HostLimits(max_sessions, call_seconds, idle_seconds, threads)
    host = SessionHost(environment_cls, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        expiring = asyncio.create_task(host.keep_expiring())
        try:
            yield
        finally:
            expiring.cancel()
            with suppress(asyncio.CancelledError):
                await expiring
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

    @app.get("/livez")
    async def livez() -> Health:
        problem = await host.liveness()
        if problem is not None:
            raise HTTPException(503, problem)
        return Health(environment=host.name, sessions=len(host.sessions))

    return app
