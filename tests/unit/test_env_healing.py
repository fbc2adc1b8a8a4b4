"""An environment server that heals instead of wedging its replica (rlhf_env.sessions,
server, client, replicas): a call past the server's deadline ends its session and lets
its lock go, liveness fails once abandoned calls hold every thread, idle sessions
expire, a connection gets its own timeout, and a session's start that a replica refuses
(no connection, or 503: full) is made on another one.

Each fault is triggered by an event (a method that blocks until the test sets it, a
session the test holds open), never by a timer; a deadline under test is short."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from rlhf_env.client import EnvironmentCallFailed, EnvironmentClient
from rlhf_env.protocol import Message, Start, Step
from rlhf_env.replicas import EnvironmentReplicas
from rlhf_env.server import app_for
from rlhf_env.sessions import HostLimits, SessionHost
from rlhf_env.toys import Lookup
from tests.environments import served

ROW = {"table": {"a": "b"}, "key": "a"}
DEADLINE = 0.3  # the server's per-call deadline in these tests
WAIT = 10.0  # what a test waits, at most, for a thing it caused


class Stuck:
    """A sync environment whose step blocks until the test sets `release` (a tool that
    hangs); records its sessions' closes."""

    release = threading.Event()
    closed: ClassVar[list[str]] = []

    def reset(self, row: dict[str, Any]) -> Start:
        self.name = str(row.get("name", "?"))
        return Start(messages=[Message(role="user", content="go")])

    def step(self, message: Message) -> Step:
        if message.content == "hang":
            self.release.wait(WAIT)
        return Step(messages=[Message(role="user", content="ok")])

    def score(self) -> float:
        return 1.0

    def close(self) -> None:
        self.closed.append(self.name)


class AsyncStuck(Stuck):
    """Stuck's async twin: its hung step can be cancelled, so its close runs."""

    gate = asyncio.Event()

    async def step(self, message: Message) -> Step:  # type: ignore[override]
        if message.content == "hang":
            await asyncio.wait_for(self.gate.wait(), WAIT)
        return Step(messages=[])


def said(text: str) -> Message:
    return Message(role="assistant", content=text)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.fixture()
def stuck() -> Iterator[str]:
    Stuck.release.clear()
    Stuck.closed.clear()
    apps = {
        "stuck": app_for(Stuck, call_seconds=DEADLINE),
        "async": app_for(AsyncStuck, call_seconds=DEADLINE),
        "one-thread": app_for(Stuck, call_seconds=DEADLINE, threads=1),
    }
    with served(apps) as url:
        yield url
    Stuck.release.set()  # no thread of a test outlives it


def test_a_sync_call_past_the_deadline_ends_its_session_and_frees_its_lock(stuck: str) -> None:
    async def scenario() -> tuple[EnvironmentCallFailed, EnvironmentCallFailed, float]:
        async with EnvironmentClient(f"{stuck}/stuck", timeout=WAIT) as env:
            hung = await env.start({"name": "hung"})
            with pytest.raises(EnvironmentCallFailed) as late:
                await env.step(hung.session, said("hang"))
            with pytest.raises(EnvironmentCallFailed) as gone:
                await env.step(hung.session, said("hi"))
            await env.close(hung.session)  # no lock held: answered (404), not waited on
            other = await env.start({"name": "other"})  # the server still serves
            await env.step(other.session, said("hi"))
            score = await env.score(other.session)
            await env.close(other.session)
        return late.value, gone.value, score

    late, gone, score = run(scenario())
    assert late.status == 504
    assert late.reason == (
        f"Stuck.step ran past the server's {DEADLINE:g} s deadline (--call-seconds); its "
        "thread still runs it; the session ends"
    )
    assert gone.status == 404 and score == 1.0
    assert Stuck.closed == ["other"]  # the hung one's instance is still in its thread


def test_an_async_call_past_the_deadline_is_cancelled_and_its_session_closed(
    stuck: str,
) -> None:
    async def scenario() -> EnvironmentCallFailed:
        AsyncStuck.gate = asyncio.Event()  # never set: the server cancels the wait
        async with EnvironmentClient(f"{stuck}/async", timeout=WAIT) as env:
            hung = await env.start({"name": "async-hung"})
            with pytest.raises(EnvironmentCallFailed) as late:
                await env.step(hung.session, said("hang"))
        return late.value

    late = run(scenario())
    assert late.status == 504 and "AsyncStuck.step ran past" in late.reason
    assert "thread" not in late.reason
    assert Stuck.closed == ["async-hung"]


def test_liveness_fails_while_abandoned_calls_hold_every_thread(stuck: str) -> None:
    async def scenario() -> list[int]:
        statuses = []
        async with EnvironmentClient(f"{stuck}/one-thread", timeout=WAIT) as env:
            statuses.append((await env._request("livez", "GET", "/livez", None, None)).status_code)
            hung = await env.start({})
            with pytest.raises(EnvironmentCallFailed):
                await env.step(hung.session, said("hang"))
            with pytest.raises(EnvironmentCallFailed) as dead:
                await env._request("livez", "GET", "/livez", None, None)
            statuses.append(dead.value.status or 0)
            assert "calls past the call deadline hold all 1 threads" in str(dead)
            Stuck.release.set()  # the tool returns at last: its thread is free again
            deadline = time.monotonic() + WAIT
            while True:
                try:
                    await env._request("livez", "GET", "/livez", None, None)
                    break
                except EnvironmentCallFailed:
                    assert time.monotonic() < deadline, "liveness did not come back"
                    await asyncio.sleep(0.02)
            statuses.append(200)
        return statuses

    assert run(scenario()) == [200, 503, 200]


def test_liveness_fails_when_the_pool_runs_nothing() -> None:
    release = threading.Event()

    class Busy(Stuck):
        def step(self, message: Message) -> Step:
            release.wait(WAIT)
            return Step(messages=[])

    async def scenario() -> tuple[str | None, str | None]:
        host = SessionHost(Busy, HostLimits(call_seconds=None, threads=1))
        started = await host.start({})
        busy = asyncio.create_task(host.step(started.session, said("x")))
        while not host.sessions[started.session].turn.locked():
            await asyncio.sleep(0)
        stalled = await host.liveness(probe_seconds=0.1)
        release.set()
        await busy
        return stalled, await host.liveness()

    stalled, live = run(scenario())
    assert stalled == (
        "the thread pool ran nothing within 0.1 s (0 of its 1 threads held by calls past "
        "the call deadline)"
    )
    assert live is None


def test_idle_sessions_expire_and_their_close_runs() -> None:
    now = [100.0]
    gate = asyncio.Event

    class Waits(AsyncStuck):
        async def step(self, message: Message) -> Step:  # type: ignore[override]
            if message.content == "hang":
                await self.gate.wait()
            return Step(messages=[])

    async def scenario() -> tuple[list[int], list[str], int]:
        Waits.gate = gate()
        host = SessionHost(Waits, HostLimits(idle_seconds=60), clock=lambda: now[0])
        idle = await host.start({"name": "idle"})
        busy = await host.start({"name": "busy"})
        stepping = asyncio.create_task(host.step(busy.session, said("hang")))
        await asyncio.sleep(0)  # its step holds its turn now
        now[0] += 60
        expired = [await host.expire_idle()]  # idle's; busy's call still runs
        Waits.gate.set()
        await stepping  # busy's call ends: at 160
        now[0] += 59
        expired.append(await host.expire_idle())
        now[0] += 1
        expired.append(await host.expire_idle())  # busy, 60 s after its call
        with pytest.raises(HTTPException) as gone:
            await host.step(idle.session, said("x"))
        return expired, list(Stuck.closed), gone.value.status_code

    Stuck.closed.clear()
    assert run(scenario()) == ([1, 0, 1], ["idle", "busy"], 404)


def test_the_server_expires_idle_sessions_by_itself() -> None:
    app = app_for(Lookup, idle_seconds=0.05)  # the TTL under test: what expires them
    with TestClient(app) as http:
        http.post("/sessions", json={"row": ROW})
        deadline = time.monotonic() + WAIT
        while http.get("/healthz").json()["sessions"]:
            assert time.monotonic() < deadline, "the session never expired"
            time.sleep(0.01)


def silent_port() -> Iterator[int]:
    """A port whose listen queue is full: a connection to it gets no answer, as one to
    a pod that is gone."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        try:
            yield port
        finally:
            for filler in fillers:
                filler.close()


def test_a_connection_that_gets_no_answer_fails_fast_as_unreachable() -> None:
    async def scenario(port: int) -> tuple[EnvironmentCallFailed, float]:
        began = time.monotonic()
        async with EnvironmentClient(
            f"http://127.0.0.1:{port}", timeout=WAIT, connect_timeout=0.2
        ) as env:
            with pytest.raises(EnvironmentCallFailed) as failed:
                await env.start(ROW)
        return failed.value, time.monotonic() - began

    for port in silent_port():
        failed, took = run(scenario(port))
        assert failed.reason == "ConnectTimeout: no connection within 0.2 s"
        assert failed.unreachable and failed.refused and not failed.connected
        assert took < WAIT / 2  # not the call's deadline


def replicas_of(urls: list[str]) -> EnvironmentReplicas:
    async def dns(url: str) -> list[str]:  # the headless Service's answer
        return urls

    return EnvironmentReplicas("http://job-env-lookup:8000", resolve=dns, timeout=WAIT)


@pytest.fixture()
def full_and_free() -> Iterator[tuple[str, str, list[int]]]:
    """Two replicas of one session each; the count of 503s they answered."""
    refused: list[int] = []

    def counted(app: FastAPI) -> FastAPI:
        @app.middleware("http")
        async def count(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            if response.status_code == 503:
                refused.append(503)
            return response

        return app

    apps = {name: counted(app_for(Lookup, max_sessions=1)) for name in ("a", "b")}
    with served(apps) as url:
        yield f"{url}/a", f"{url}/b", refused


def test_a_start_that_a_full_replica_refuses_is_made_on_another(
    full_and_free: tuple[str, str, list[int]],
) -> None:
    full, free, refused = full_and_free

    async def scenario() -> tuple[str, dict[str, int]]:
        async with EnvironmentClient(full) as other_trainer:
            await other_trainer.start(ROW)  # `full` holds its one session now
            replicas = replicas_of([full, free])
            async with replicas.session() as environment:  # fewest open here: `full`
                started = await environment.start(ROW)
                await environment.close(started.session)
                placed, counts = environment.url, dict(replicas._open)
            await replicas.aclose()
        return placed, counts

    placed, counts = run(scenario())
    assert placed == free and refused == [503]
    assert counts == {full: 0, free: 1}  # counted where it started


def test_a_start_waits_for_room_when_every_replica_is_full(
    full_and_free: tuple[str, str, list[int]],
) -> None:
    full, _, refused = full_and_free

    async def scenario() -> str:
        async with EnvironmentClient(full) as other_trainer:
            held = await other_trainer.start(ROW)
            replicas = replicas_of([full])
            async with replicas.session() as environment:
                starting = asyncio.create_task(environment.start(ROW))
                deadline = time.monotonic() + WAIT
                while not refused:  # it was refused at least once: it is waiting
                    assert time.monotonic() < deadline and not starting.done()
                    await asyncio.sleep(0.01)
                await other_trainer.close(held.session)  # room
                started = await starting
                await environment.close(started.session)
            await replicas.aclose()
        return started.session

    assert run(scenario())


def test_a_start_on_a_replica_that_is_gone_is_made_on_another(
    full_and_free: tuple[str, str, list[int]],
) -> None:
    _, free, _ = full_and_free
    gone = "http://127.0.0.1:9"  # nothing listens

    async def scenario() -> tuple[str, bool]:
        replicas = replicas_of([gone, free])
        async with replicas.session() as environment:
            started = await environment.start(ROW)
            await environment.close(started.session)
            placed = environment.url
        down = not await replicas.others([free])  # the gone one is left out a while
        await replicas.aclose()
        return placed, down

    assert run(scenario()) == (free, True)
