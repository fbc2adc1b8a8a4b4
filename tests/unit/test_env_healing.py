"""An environment server that heals instead of wedging its replica (rlhf_env.sessions,
server, client, replicas): a call past the server's deadline ends its session and lets
its lock go, liveness fails once abandoned calls hold every thread, idle sessions
expire, and a connection gets its own timeout (a start made on another replica:
test_env_replicas.py).

Each fault is triggered by an event (a method that blocks until the test sets it, a
session the test holds open), never by a timer; a deadline under test is short."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from fastapi import HTTPException
from fastapi.testclient import TestClient

from rlhf_env.client import EnvironmentCallFailed, EnvironmentClient
from rlhf_env.process import free_port, served_locally, wait_until_healthy
from rlhf_env.protocol import Message, Start, Step
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


class Hangs(Stuck):
    """A tool that never returns (served in a process of its own)."""

    def step(self, message: Message) -> Step:
        threading.Event().wait()
        raise AssertionError("unreachable")


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


def test_a_close_waiting_on_a_hung_call_does_not_call_into_its_instance() -> None:
    async def scenario() -> tuple[int, list[str]]:
        host = SessionHost(Stuck, HostLimits(call_seconds=DEADLINE))
        started = await host.start({"name": "hung"})
        stepping = asyncio.create_task(host.step(started.session, said("hang")))
        while not host.sessions[started.session].turn.locked():
            await asyncio.sleep(0)
        closing = asyncio.create_task(host.close(started.session))  # waits for the turn
        with pytest.raises(HTTPException) as late:
            await stepping
        await closing
        return late.value.status_code, list(Stuck.closed)

    Stuck.closed.clear()
    Stuck.release.clear()
    try:
        assert run(scenario()) == (504, [])  # its thread still has the instance
    finally:
        Stuck.release.set()


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


def test_a_server_whose_threads_hang_still_exits_on_sigterm() -> None:
    """A restart (liveness failed) is a SIGTERM: the server must go at once, not wait for
    its hung threads (as an exit through Python's own would: it joins its pools'
    threads), keeping the pod through its grace period. uvicorn ends on the signal
    itself, after the lifespan's shutdown, which must not wait for them either."""
    port, target = free_port(), "tests.unit.test_env_healing:Hangs"
    command = [sys.executable, "-m", "rlhf_env", "serve", target, "--port", str(port),
               "--call-seconds", str(DEADLINE), "--log-level", "warning"]  # fmt: skip
    with tempfile.TemporaryFile() as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_healthy(url, server, target, output)

            async def hang() -> int | None:
                async with EnvironmentClient(url, timeout=WAIT) as env:
                    started = await env.start({})
                    with pytest.raises(EnvironmentCallFailed) as late:
                        await env.step(started.session, said("hang"))
                return late.value.status

            assert run(hang()) == 504
            server.send_signal(signal.SIGTERM)
            assert server.wait(WAIT) == -signal.SIGTERM
        finally:
            server.kill()
            server.wait()


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


def test_the_command_line_takes_the_limits_and_serves_livez() -> None:
    """As the operator's pod runs it, with the spec's flags (and a local run may)."""
    options = ["--max-sessions", "1", "--call-seconds", "5", "--idle-seconds", "600"]

    async def scenario(url: str) -> tuple[int, EnvironmentCallFailed]:
        async with EnvironmentClient(url) as env:
            live = await env._request("livez", "GET", "/livez", None, None)
            await env.start(ROW)
            with pytest.raises(EnvironmentCallFailed) as full:
                await env.start(ROW)
        return live.status_code, full.value

    with served_locally("rlhf_env.toys:Lookup", options) as url:
        live, full = run(scenario(url))
    assert live == 200
    assert full.status == 503 and full.refused and full.connected
