"""An agent that owns its loop, served over the agent protocol (agent_protocol.py).

    from rlhf_env.agent import serve

    async def run(task: dict, client: openai.AsyncOpenAI) -> float | None:
        ...  # the agent's own loop: client.chat.completions.create(...), tools, ...

    if __name__ == "__main__":
        serve(run, host="0.0.0.0")

`python -m rlhf_env agent module:function` serves the same function without the last two
lines. For each episode the adapter builds an `openai.AsyncOpenAI` on the gateway's
base_url and the episode's key, over one HTTP connection pool that every episode shares,
and awaits `run(task, client)`; a `run` that also takes
`model` gets the name the gateway serves the policy under. It returns the reward, None
(the job's reward judges the episode), or an EpisodeResult (a reward and numbers to count).

Answers: a `run` that raises is a 500 naming the function and the error; one past the
episode's deadline is cancelled, and a 504; past `max_episodes` at once, a 503 (the
trainer starts the episode on another replica). A body that breaks the protocol is a 422
naming the field, without echoing what was sent (it holds the key). The key is never
logged. GET /healthz answers protocol.Health: the function's name, the episodes running.

This module needs the `openai` package (in the trainer image); the rest of rlhf_env does
not, and `python -m rlhf_env serve` never imports it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import openai
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlhf_env.agent_protocol import EPISODES_PATH, EpisodeRequest, EpisodeResult
from rlhf_env.environment import NotAnEnvironment
from rlhf_env.protocol import Health
from rlhf_env.sessions import explain

log = logging.getLogger(__name__)

# What an agent is: async def run(task, client) -> float | None | EpisodeResult
AgentRun = Callable[..., Awaitable[float | EpisodeResult | None]]


class NotAnAgent(NotAnEnvironment):
    """The function given cannot serve episodes (the loader's error, as for a class)."""


def app_for_agent(run: AgentRun, *, max_episodes: int | None = None) -> FastAPI:
    """An ASGI app serving `run` over the agent protocol, at most `max_episodes` episodes
    at once (None: no bound)."""
    host = _AgentHost(run, max_episodes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await host.aclose()

    app = FastAPI(title=f"{host.name} agent", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def refused(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes the input, and an EpisodeRequest's holds the key.
        problems = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in error.errors()]
        return JSONResponse({"detail": problems}, status_code=422)

    @app.post(EPISODES_PATH)
    async def episode(request: EpisodeRequest) -> EpisodeResult:
        return await host.episode(request)

    @app.get("/healthz")
    async def healthz() -> Health:
        return Health(environment=host.name, sessions=host.running)

    return app


def serve(
    run: AgentRun,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_episodes: int | None = None,
    log_level: str = "info",
) -> None:
    """Serve `run` until interrupted. Loopback unless asked: in a pod, host="0.0.0.0"."""
    app = app_for_agent(run, max_episodes=max_episodes)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=host, port=port, log_level=log_level)


class _AgentHost:
    """The episodes of one agent function. Runs on the server's one event loop: the count
    needs no lock (no `await` between its check and its change)."""

    def __init__(self, run: AgentRun, max_episodes: int | None) -> None:
        self.name = check_agent(run)
        self.run, self.max_episodes = run, max_episodes
        self.wants_model = "model" in inspect.signature(run).parameters
        self.running = 0
        # Every episode's client shares one pool: a client of its own took 16-30 ms to
        # build and a new connection per episode (bench-agent-gateway).
        self.http: openai.DefaultAsyncHttpxClient | None = None

    def shared_http(self) -> openai.DefaultAsyncHttpxClient:
        if self.http is None or self.http.is_closed:
            self.http = openai.DefaultAsyncHttpxClient()
        return self.http

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def episode(self, request: EpisodeRequest) -> EpisodeResult:
        if self.max_episodes is not None and self.running >= self.max_episodes:
            raise HTTPException(
                503, f"{self.running} episodes are running, the most this agent runs at once"
            )
        self.running += 1
        try:
            returned = await self._run(request)
        finally:
            self.running -= 1
        return self._result(returned)

    async def _run(self, request: EpisodeRequest) -> Any:
        """`run` on the episode's task, with a client of the gateway, cancelled at the
        deadline. Only the episode's id is logged: its key is a credential."""
        deadline = request.deadline_seconds
        log.debug("episode %s starts", request.episode_id)
        extra = {"model": request.model} if self.wants_model else {}
        # Not closed after the episode: closing it would close the shared pool.
        client = openai.AsyncOpenAI(
            base_url=request.base_url,
            api_key=request.api_key,
            timeout=deadline,
            http_client=self.shared_http(),
        )
        try:
            async with asyncio.timeout(deadline):
                return await self.run(request.task, client, **extra)
        except TimeoutError:
            detail = f"{self.name} ran past the episode's {deadline:g} s deadline; cancelled"
            raise HTTPException(504, detail) from None
        except Exception as error:  # the agent's own code may fail in any way
            log.warning("episode %s: %s raised", request.episode_id, self.name, exc_info=True)
            raise HTTPException(500, f"{self.name} raised {explain(error)}") from error

    def _result(self, returned: Any) -> EpisodeResult:
        """What `run` returned, as an EpisodeResult; a 500 naming what it was instead."""
        if isinstance(returned, EpisodeResult):
            result = returned
        elif returned is None or type(returned) in (int, float):  # not a bool
            result = EpisodeResult(reward=returned)
        else:
            raise HTTPException(
                500,
                f"{self.name} returned a {type(returned).__name__}: expected a float, None "
                "or an EpisodeResult",
            )
        if result.reward is not None and not math.isfinite(result.reward):
            raise HTTPException(500, f"{self.name} returned the reward {result.reward}")
        return result


def check_agent(run: Any) -> str:
    """The agent's name, module:function; NotAnAgent unless `run` is an async function."""
    name = f"{getattr(run, '__module__', '?')}:{getattr(run, '__qualname__', repr(run))}"
    if not inspect.iscoroutinefunction(run):
        raise NotAnAgent(
            f"{name} is not an async function: an agent is "
            "`async def run(task, client)`, client an openai.AsyncOpenAI"
        )
    return name
