"""The trainer's side of the protocol: an async client, one per environment server.

    async with EnvironmentClient("http://lookup:8000") as environment:
        started = await environment.start(row)
        stepped = await environment.step(started.session, assistant_message)
        reward = await environment.score(started.session)
        await environment.close(started.session)

A connection is given CONNECT_SECONDS: a pod that is gone (its address answers nothing)
fails the call as unreachable in seconds, not at the call's deadline, so the trainer
starts its episode on another replica.

Every failure is one exception, EnvironmentCallFailed, whose message names the call, the
URL and what went wrong (the status and the server's reason, a timeout, a refused
connection, an answer that breaks the protocol), so a trainer's log says which
environment failed and why without a traceback from inside httpx.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from rlhf_env.protocol import (
    Health,
    Message,
    Scored,
    Started,
    StartRequest,
    Step,
    StepRequest,
    describe,
)

Answer = TypeVar("Answer", bound=BaseModel)

# An idle connection is reused only this long: well inside a server's own keep-alive
# (uvicorn 5 s, gunicorn 2 s). A request sent as the server closes an idle connection is
# lost (httpx.ReadError; measured against uvicorn after 4.997-4.999 s idle), and the
# server's loop closes it later the busier it is.
KEEPALIVE_SECONDS = 1.0
# An answer is read at most this far: an environment that sends more (a tool result of
# gigabytes) fails its call, as one that breaks the protocol, before it fills memory.
MAX_ANSWER_BYTES = 32 * 2**20
# A connection within a cluster opens in milliseconds; one to a pod that is gone gets no
# answer at all (the kernel retries its SYN for minutes).
CONNECT_SECONDS = 5.0
ENCODING = {"content-encoding", "content-length", "transfer-encoding"}  # of a body as sent


# How a call failed: the connection failed or broke (the server is gone), no answer in
# time, an error the server sent (an HTTP error status), or an answer that breaks the
# protocol.
FailureKind = Literal["unreachable", "timeout", "error", "protocol"]


class EnvironmentCallFailed(Exception):
    """A call to an environment server that got no valid answer, and how (`kind`)."""

    def __init__(
        self,
        call: str,
        url: str,
        reason: str,
        status: int | None = None,
        *,
        kind: FailureKind = "error",
        connected: bool = True,
        service: str = "environment",
    ) -> None:
        self.call, self.url, self.reason, self.status = call, url, reason, status
        self.kind = kind
        self.connected = connected  # False: no connection was opened, nothing was sent
        status_text = f"HTTP {status}: " if status is not None else ""
        super().__init__(f"{service} {call} at {url} failed: {status_text}{reason}")

    @property
    def unreachable(self) -> bool:
        return self.kind == "unreachable"

    @property
    def refused(self) -> bool:
        """Whether the server took no part in the call: no connection opened, or a 503
        (full). Another replica may take it; this one holds nothing of it."""
        return not self.connected or self.status == 503


class ClosedOnExit:
    """`async with client:` closes it on the way out (its `aclose`)."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


class EnvironmentClient(ClosedOnExit):
    """Calls one environment server. `timeout` is each call's whole deadline, in seconds
    (connecting, sending, the environment's work, the answer); each call can override it.
    `connect_timeout`: opening a connection, within that deadline. `service` names the
    server in failures: "environment", or another protocol's (an agent, with `call`)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        connect_timeout: float = CONNECT_SECONDS,
        headers: dict[str, str] | None = None,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        service: str = "environment",
    ) -> None:
        self.url = url.rstrip("/")
        self.service = service
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.max_answer_bytes = max_answer_bytes
        # httpx's own timeouts are per read or write; the call's deadline is ours
        # (asyncio.timeout). Only connecting has one of its own.
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(None, connect=connect_timeout),
            headers=headers,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_SECONDS),
        )

    async def start(self, row: dict[str, Any], *, timeout: float | None = None) -> Started:
        body = StartRequest(row=row).model_dump(mode="json")
        return await self.call("start", "POST", "/sessions", Started, body, timeout)

    async def step(self, session: str, message: Message, *, timeout: float | None = None) -> Step:
        body = StepRequest(message=message).model_dump(mode="json")
        return await self.call("step", "POST", f"/sessions/{session}/step", Step, body, timeout)

    async def score(self, session: str, *, timeout: float | None = None) -> float:
        path = f"/sessions/{session}/score"
        scored = await self.call("score", "POST", path, Scored, None, timeout)
        return scored.score

    async def close(self, session: str, *, timeout: float | None = None) -> None:
        """End the session. One the server already ended (its class failed) is no error:
        a trainer closes every session it started, in `finally`, whatever happened."""
        try:
            await self._request("close", "DELETE", f"/sessions/{session}", None, timeout)
        except EnvironmentCallFailed as failed:
            if failed.status != 404:
                raise

    async def health(self, *, timeout: float | None = None) -> Health:
        return await self.call("health", "GET", "/healthz", Health, None, timeout)

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(
        self,
        call: str,
        method: str,
        path: str,
        answer: type[Answer],
        body: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Answer:
        """One request, its answer parsed as `answer`: each call above, and another
        protocol's on the same footing (the agent protocol's episodes)."""
        response = await self._request(call, method, path, body, timeout)
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as error:
            reason = f"the answer breaks the protocol: {describe(error)}"
            raise EnvironmentCallFailed(
                call, str(response.url), reason, response.status_code, kind="protocol",
                service=self.service,
            ) from error  # fmt: skip

    async def _request(
        self, call: str, method: str, path: str, body: dict[str, Any] | None, timeout: float | None
    ) -> httpx.Response:
        """One request under the call's deadline; EnvironmentCallFailed unless it succeeded."""
        url = self.url + path
        deadline = self.timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):
                request = self._http.build_request(method, path, json=body)
                response = await self._read(call, await self._http.send(request, stream=True))
        except TimeoutError as error:
            reason = f"no answer within {deadline:g} s"
            raise EnvironmentCallFailed(
                call, url, reason, kind="timeout", service=self.service
            ) from error
        except httpx.HTTPError as error:
            if isinstance(error, httpx.ConnectTimeout):
                reason = f"ConnectTimeout: no connection within {self.connect_timeout:g} s"
            else:
                reason = f"{type(error).__name__}: {str(error) or 'no detail'}"
            gone = isinstance(error, httpx.TransportError)
            never = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
            raise EnvironmentCallFailed(
                call, url, reason, kind="unreachable" if gone else "error",
                connected=not never, service=self.service,
            ) from error  # fmt: skip
        if not response.is_success:
            reason = server_reason(response)
            raise EnvironmentCallFailed(
                call, url, reason, response.status_code, service=self.service
            )
        return response

    async def _read(self, call: str, response: httpx.Response) -> httpx.Response:
        """The streamed `response`, read whole if it is at most max_answer_bytes."""
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self.max_answer_bytes:
                    reason = f"its answer is over {self.max_answer_bytes} bytes"
                    raise EnvironmentCallFailed(
                        call, str(response.url), reason, response.status_code,
                        kind="protocol", service=self.service,
                    )  # fmt: skip
                chunks.append(chunk)
        finally:
            await response.aclose()
        # Decoded already: the headers that describe the encoded body go.
        headers = [(k, v) for k, v in response.headers.items() if k.lower() not in ENCODING]
        return httpx.Response(
            response.status_code,
            headers=headers,
            content=b"".join(chunks),
            request=response.request,
        )


def server_reason(response: httpx.Response) -> str:
    """The server's `detail`, in one line; the body's start if it sent something else."""
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase
    if isinstance(detail, list):  # FastAPI's 422: a list of field errors
        return "; ".join(
            ".".join(str(part) for part in problem.get("loc", [])) + ": " + problem.get("msg", "")
            for problem in detail
            if isinstance(problem, dict)
        )
    return str(detail)
