"""The environment protocol over real HTTP: a uvicorn server in a thread serves the toys and
a few test classes (each mounted under its own path), and the trainer's client drives
them. No mocks: what a trainer would see is what is asserted."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx
import pytest
from pydantic import ValidationError

from rlhf_env.__main__ import main
from rlhf_env.client import KEEPALIVE_SECONDS, EnvironmentCallFailed, EnvironmentClient
from rlhf_env.process import EnvironmentDidNotStart, served_locally
from rlhf_env.protocol import FunctionCall, Message, Start, Step, Tool, ToolCall, describe
from rlhf_env.server import app_for
from rlhf_env.toys import Calculator, Lookup
from tests.environments import served

ROOT = Path(__file__).parents[2]
T = TypeVar("T")


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


def user(text: str) -> Start:
    return Start(messages=[Message(role="user", content=text)])


def calls(*called: tuple[str, str]) -> Message:
    """An assistant message calling tools: (name, JSON arguments) each."""
    tool_calls = [
        ToolCall(id=f"call-{i}", function=FunctionCall(name=name, arguments=arguments))
        for i, (name, arguments) in enumerate(called)
    ]
    return Message(role="assistant", tool_calls=tool_calls)


def answer(text: str) -> Message:
    return Message(role="assistant", content=text)


# --- test environments, beside the toys ---


class Counter:
    """Async methods; each session counts from its row's start, so mixed state shows."""

    async def reset(self, row: dict[str, Any]) -> Start:
        self.count = int(row["start"])
        return user(f"count from {self.count}")

    async def step(self, message: Message) -> Step:
        await asyncio.sleep(0)  # let the other sessions' calls interleave
        self.count += 1
        return Step(messages=[], reward=float(self.count), done=message.content == "stop")

    async def score(self) -> float:
        return float(self.count)


class Exploding:
    """Fails in its first step; records that its session was closed."""

    closed: ClassVar[list[str]] = []

    def reset(self, row: dict[str, Any]) -> Start:
        self.name = row["name"]
        return user("go")

    def step(self, message: Message) -> Step:
        raise RuntimeError(f"the tool broke for {self.name}")

    def score(self) -> float:
        return 0.0

    def close(self) -> None:
        Exploding.closed.append(self.name)


class BadSchema:
    """Offers a tool whose argument has a type JSON Schema does not know."""

    def reset(self, row: dict[str, Any]) -> dict[str, Any]:
        search = {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "strng"}}},
        }
        return {
            "messages": [{"role": "user", "content": "find it"}],
            "tools": [{"type": "function", "function": search}],
        }

    def step(self, message: Message) -> Step:
        return Step(messages=[])

    def score(self) -> float:
        return 0.0


class Rendezvous:
    """Two sessions' steps must meet: they can only if sync methods run in threads, side
    by side, rather than one at a time on the event loop."""

    meeting = threading.Barrier(2, timeout=10)

    def reset(self, row: dict[str, Any]) -> Start:
        return user("meet")

    def step(self, message: Message) -> Step:
        Rendezvous.meeting.wait()
        return Step(messages=[], done=True)

    def score(self) -> float:
        return 1.0


class Slow:
    async def reset(self, row: dict[str, Any]) -> Start:
        return user("wait")

    async def step(self, message: Message) -> Step:
        await asyncio.sleep(1.5)
        return Step(messages=[])

    def score(self) -> float:
        return 0.0


MOUNTED: dict[str, Any] = {
    "lookup": app_for(Lookup),
    "calculator": app_for(Calculator),
    "counter": app_for(Counter),
    "exploding": app_for(Exploding),
    "bad-schema": app_for(BadSchema),
    "rendezvous": app_for(Rendezvous),
    "slow": app_for(Slow),
    "one-at-a-time": app_for(Lookup, max_sessions=1),
}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The base URL of a real uvicorn server, in a thread, serving every test class."""
    with served(MOUNTED) as url:
        yield url


# --- the contract, without a server ---


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        (
            {"name": "search", "parameters": {"type": "objekt"}},
            "function: tool 'search': parameters is not a valid JSON Schema: 'objekt' is not valid under any of the given schemas, at parameters['type']",
        ),
        (
            {"name": "search", "parameters": {"type": "object", "required": "q"}},
            "function: tool 'search': parameters is not a valid JSON Schema: 'q' is not of type 'array', at parameters['required']",
        ),
        (
            {"name": "search", "parameters": {"type": "string"}},
            "function: tool 'search': parameters must describe an object (\"type\": \"object\"), got type 'string'",
        ),
        (
            {"name": "two words", "parameters": {"type": "object"}},
            "function.name: String should match pattern '^[a-zA-Z0-9_-]{1,64}$'",
        ),
    ],
)
def test_a_bad_tool_schema_is_refused_with_the_reason(
    function: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        Tool.model_validate({"type": "function", "function": function})
    assert describe(refused.value) == reason


def test_tool_names_are_unique_and_tool_calls_belong_to_the_assistant() -> None:
    lookup = {"type": "function", "function": {"name": "lookup"}}
    with pytest.raises(
        ValidationError, match=r"tool names must be unique, these repeat: \['lookup'\]"
    ):
        Start.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "tools": [lookup, lookup]}
        )
    with pytest.raises(ValidationError, match="a user message cannot carry tool_calls"):
        Message.model_validate(
            {"role": "user", "tool_calls": [{"id": "1", "function": {"name": "lookup"}}]}
        )
    with pytest.raises(ValidationError, match="tool_call_id is required on tool messages"):
        Message.model_validate({"role": "tool", "content": "42"})
    assert FunctionCall(name="f", arguments='{"a": 1}').parsed_arguments() == {"a": 1}
    with pytest.raises(ValueError, match="arguments must be a JSON object, got \\[1\\]"):
        FunctionCall(name="f", arguments="[1]").parsed_arguments()


# --- whole sessions of the toys ---


def test_a_lookup_session_from_start_to_score(server: str) -> None:
    async def scenario() -> tuple[Any, ...]:
        async with EnvironmentClient(f"{server}/lookup", timeout=10) as env:
            before = await env.health()
            started = await env.start({"table": {"apple": "red", "lime": "green"}, "key": "lime"})
            during = await env.health()
            looked_up = await env.step(
                started.session,
                calls(
                    ("lookup", '{"key": "lime"}'), ("lookup", '{"key": "kiwi"}'), ("search", "{}")
                ),
            )
            answered = await env.step(started.session, answer(" green "))
            score = await env.score(started.session)
            await env.close(started.session)
            live = [before.sessions, during.sessions, (await env.health()).sessions]
            return started, looked_up, answered, score, live

    started, looked_up, answered, score, live = run(scenario)
    assert (
        started.messages[0].content
        == "What is the value of the key 'lime'? Use the lookup tool, then reply with the value alone."
    )
    assert [tool.function.name for tool in started.tools] == ["lookup"]
    assert started.tools[0].function.parameters["required"] == ["key"]
    assert [(m.role, m.tool_call_id, m.content) for m in looked_up.messages] == [
        ("tool", "call-0", "green"),
        ("tool", "call-1", "no key 'kiwi' in the table"),
        ("tool", "call-2", "error: no tool named 'search'"),
    ]
    assert not looked_up.done and looked_up.reward is None
    assert answered.done and answered.messages == []
    assert score == 1.0
    assert live == [live[0], live[0] + 1, live[0]]


def test_a_wrong_lookup_answer_scores_zero(server: str) -> None:
    async def scenario() -> float:
        async with EnvironmentClient(f"{server}/lookup") as env:
            started = await env.start({"table": {"apple": "red"}, "key": "apple"})
            await env.step(started.session, answer("green"))
            score = await env.score(started.session)
            await env.close(started.session)
            return score

    assert run(scenario) == 0.0


def test_a_calculator_session_evaluates_safely(server: str) -> None:
    async def scenario() -> tuple[Any, ...]:
        async with EnvironmentClient(f"{server}/calculator") as env:
            started = await env.start({"numbers": [12, 30, 7]})
            expressions = [
                "12 + 30 + 7",
                "2 * (3 - 10)",
                "2 ** 100",
                "__import__('os')",
                "1 / 2",
                "12 +",
            ]
            arguments = [json.dumps({"expression": e}) for e in expressions] + [
                '{"expression": 3}',
                "no JSON",
            ]
            tools = await env.step(started.session, calls(*(("calculate", a) for a in arguments)))
            await env.step(started.session, answer("49"))
            return started, tools, await env.score(started.session)

    started, tools, score = run(scenario)
    assert (
        started.messages[0].content
        == "What is 12 + 30 + 7? Use the calculate tool, then reply with the number alone."
    )
    assert [m.content for m in tools.messages] == [
        "49",
        "-14",
        "error: only integers, + - * and parentheses: not '2 ** 100'",
        "error: only integers, + - * and parentheses: not \"__import__('os')\"",
        "error: only integers, + - * and parentheses: not '1 / 2'",
        "error: cannot parse '12 +'",
        "error: object of type 'int' has no len()",
        "error: arguments are not JSON: Expecting value: line 1 column 1 (char 0)",
    ]
    assert score == 1.0


def test_concurrent_sessions_keep_their_own_state(server: str) -> None:
    async def one(
        env: EnvironmentClient, start: int, steps: int
    ) -> tuple[list[float | None], float]:
        started = await env.start({"start": start})
        rewards = [(await env.step(started.session, answer("more"))).reward for _ in range(steps)]
        score = await env.score(started.session)
        await env.close(started.session)
        return rewards, score

    async def scenario() -> list[tuple[list[float | None], float]]:
        async with EnvironmentClient(f"{server}/counter") as env:
            return await asyncio.gather(*(one(env, 100 * i, i) for i in range(1, 9)))

    for i, (rewards, score) in enumerate(run(scenario), start=1):
        assert rewards == [float(100 * i + k) for k in range(1, i + 1)]
        assert score == 100 * i + i


def test_sync_methods_run_side_by_side_in_threads(server: str) -> None:
    async def scenario() -> list[bool]:
        async with EnvironmentClient(f"{server}/rendezvous", timeout=15) as env:
            sessions = [(await env.start({})).session for _ in range(2)]
            stepped = await asyncio.gather(*(env.step(s, answer("here")) for s in sessions))
            return [step.done for step in stepped]

    assert run(scenario) == [True, True]


# --- what failures look like ---


def test_an_error_in_the_class_names_it_and_ends_the_session(server: str) -> None:
    url = f"{server}/exploding"

    async def scenario() -> tuple[str, EnvironmentCallFailed, EnvironmentCallFailed]:
        async with EnvironmentClient(url) as env:
            started = await env.start({"name": "episode-7"})
            with pytest.raises(EnvironmentCallFailed) as failed:
                await env.step(started.session, answer("hi"))
            with pytest.raises(EnvironmentCallFailed) as gone:
                await env.score(started.session)
            await env.close(started.session)  # already ended: no error
            return started.session, failed.value, gone.value

    session, failed, gone = run(scenario)
    assert str(failed) == (
        f"environment step at {url}/sessions/{session}/step failed: HTTP 500: "
        "Exploding.step raised RuntimeError: the tool broke for episode-7"
    )
    assert (failed.call, failed.status) == ("step", 500)
    assert Exploding.closed == ["episode-7"]
    assert gone.status == 404
    assert f"no session {session!r}: it was closed, it failed, it expired, or it" in str(gone)


def test_a_bad_schema_from_reset_is_refused_with_the_tool_and_reason(server: str) -> None:
    async def scenario() -> EnvironmentCallFailed:
        async with EnvironmentClient(f"{server}/bad-schema") as env:
            with pytest.raises(EnvironmentCallFailed) as refused:
                await env.start({})
            assert (await env.health()).sessions == 0
            return refused.value

    refused = run(scenario)
    assert refused.status == 500
    assert (
        "BadSchema.reset returned an invalid Start: tools.0.function: tool 'search': parameters "
        "is not a valid JSON Schema: 'strng' is not valid under any of the given schemas, "
        "at parameters['properties']['q']['type']"
    ) in str(refused)


def test_an_unknown_session_is_a_404_naming_it(server: str) -> None:
    async def scenario() -> EnvironmentCallFailed:
        async with EnvironmentClient(f"{server}/lookup") as env:
            with pytest.raises(EnvironmentCallFailed) as unknown:
                await env.step("no-such-session", answer("hi"))
            return unknown.value

    unknown = run(scenario)
    assert unknown.status == 404
    assert "no session 'no-such-session'" in str(unknown)


def test_a_body_that_breaks_the_protocol_is_a_422(server: str) -> None:
    with httpx.Client(base_url=f"{server}/lookup") as http:
        started = http.post("/sessions", json={"row": {"table": {"a": "b"}, "key": "a"}}).json()
        stepped = http.post(
            f"/sessions/{started['session']}/step",
            json={"message": {"role": "user", "content": "hi"}},
        )
        no_row = http.post("/sessions", json={"rows": []})
        closed = http.delete(f"/sessions/{started['session']}")
    assert stepped.status_code == 422
    assert "a step takes an assistant message, got role user" in stepped.text
    assert no_row.status_code == 422 and '"loc":["body","row"]' in no_row.text
    assert closed.status_code == 204  # a refused body leaves the session as it was


def test_a_full_server_refuses_new_sessions(server: str) -> None:
    async def scenario() -> EnvironmentCallFailed:
        async with EnvironmentClient(f"{server}/one-at-a-time") as env:
            first = await env.start({"table": {"a": "b"}, "key": "a"})
            with pytest.raises(EnvironmentCallFailed) as full:
                await env.start({"table": {"a": "b"}, "key": "a"})
            await env.close(first.session)
            again = await env.start({"table": {"a": "b"}, "key": "a"})  # room again
            await env.close(again.session)
            return full.value

    full = run(scenario)
    assert full.status == 503 and "1 sessions are open, the most this server holds" in str(full)


def test_a_call_past_its_deadline_and_a_server_that_is_not_there(server: str) -> None:
    async def scenario() -> tuple[EnvironmentCallFailed, EnvironmentCallFailed]:
        async with EnvironmentClient(f"{server}/slow") as env:
            started = await env.start({})
            with pytest.raises(EnvironmentCallFailed) as late:
                await env.step(started.session, answer("hi"), timeout=0.2)
        async with EnvironmentClient("http://127.0.0.1:9/nowhere", timeout=5) as env:
            with pytest.raises(EnvironmentCallFailed) as refused:
                await env.start({})
        return late.value, refused.value

    late, refused = run(scenario)
    assert str(late).endswith("/step failed: no answer within 0.2 s")
    assert (refused.kind, late.kind) == ("unreachable", "timeout")  # gone, or slow
    assert refused.unreachable and not late.unreachable
    assert str(refused).startswith(
        "environment start at http://127.0.0.1:9/nowhere/sessions failed: ConnectError"
    )


@asynccontextmanager
async def closing_idle_connections() -> AsyncIterator[tuple[str, list[int]]]:
    """A server that answers a connection's first health check and closes the connection
    at its next request unanswered, as a server does when its keep-alive ends just as a
    request arrives. Yields its URL and the number of requests of each connection."""
    served: list[int] = []
    health = b'{"status": "ok", "environment": "idle", "sessions": 0}'
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    answer += str(len(health)).encode() + b"\r\n\r\n" + health

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(0)
        while await reader.readuntil(b"\r\n\r\n"):
            served[-1] += 1
            if served[-1] > 1:
                break
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", served


def test_a_connection_left_idle_is_not_reused_after_the_server_may_have_closed_it() -> None:
    """A call after an idle gap (the episodes of the next step, after a training step) is
    sent on a new connection: one racing the server's keep-alive would be lost."""

    async def scenario() -> list[int]:
        async with closing_idle_connections() as (url, served):
            async with EnvironmentClient(url, timeout=5) as env:
                await env.health()
                await asyncio.sleep(KEEPALIVE_SECONDS * 1.5)
                await env.health()
            return served

    assert run(scenario) == [1, 1]


# --- the command line ---


def test_serve_runs_a_class_from_a_module_in_a_process_of_its_own() -> None:
    """`python -m rlhf_env serve`, started as a local run starts it (served_locally)."""
    with served_locally("tests.unit.test_env_protocol:Counter") as url:

        async def scenario() -> tuple[float, str]:
            async with EnvironmentClient(url) as client:
                started = await client.start({"start": 41})
                await client.step(started.session, answer("stop"))
                score = await client.score(started.session)
                await client.close(started.session)
                return score, (await client.health()).environment

        assert run(scenario) == (42.0, "Counter")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=1)  # stopped on leaving


def test_a_class_that_cannot_be_served_fails_naming_it_with_the_servers_words() -> None:
    with pytest.raises(EnvironmentDidNotStart) as failed, served_locally("rlhf_env.toys:Nope"):
        pass
    assert "the environment rlhf_env.toys:Nope exited with status 2" in str(failed.value)
    assert "module 'rlhf_env.toys' has no attribute 'Nope'" in str(failed.value)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("Counter", "expected module:Class (e.g. my_envs:Lookup), got 'Counter'"),
        (
            "no_such_module:Lookup",
            "cannot import module 'no_such_module' (from 'no_such_module:Lookup'): ModuleNotFoundError: No module named 'no_such_module'",
        ),
        ("rlhf_env.toys:Nope", "module 'rlhf_env.toys' has no attribute 'Nope'"),
        ("rlhf_env.toys:calculate", "rlhf_env.toys:calculate is a function, expected a class"),
        (
            "rlhf_env.protocol:Tool",
            "rlhf_env.protocol:Tool is not an environment: it lacks reset, step, score (an environment has reset, step, score)",
        ),
    ],
)
def test_a_bad_target_says_what_was_expected(
    target: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", target]) == 2
    assert capsys.readouterr().err == f"python -m rlhf_env serve: {message}\n"
