"""The agent protocol end to end: agent functions served by rlhf_env.agent, and the
trainer's AgentClient (rlhf_trainer.rollout.agent_client) calling them, over real HTTP on
loopback (tests.environments.served: uvicorn in a thread; the example agent once as
`python -m rlhf_env agent`, as a local run starts it).

Two stand-ins, for what is not the subject here:
- StandInGateway answers the agents' chat completions as scripted and records each
  call: the real gateway (rlhf_trainer.gateway) is tested on its own. The example
  agent's loop runs against it with the real `openai` client, a tool call included.
- A headless Service's DNS answer is a resolver returning the replicas' URLs.

Faults come on events: an agent that waits on an Event never set (the deadline cuts it),
one held until the test releases it (its replica is full), a port nothing listens on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from examples.agents import letters_agent
from rlhf_env.agent import NotAnAgent, app_for_agent
from rlhf_env.agent_protocol import EpisodeRequest, EpisodeResult
from rlhf_env.process import EnvironmentDidNotStart, served_locally
from rlhf_env.protocol import Message
from rlhf_env.server import app_for
from rlhf_env.toys import LetterLookup, Lookup
from rlhf_trainer.api.agents import AgentConfig
from rlhf_trainer.rollout.agent_client import AGENT_CUT_REASONS, AgentClient, AgentEpisodeFailed
from tests.environments import served

WAIT = 10.0  # what a test waits, at most, for a thing it caused
KEY = "sk-episode-7f3a"  # an episode's key: it must appear in no log and no answer
GONE = "http://127.0.0.1:9"  # nothing listens


def request(
    task: dict[str, Any], base_url: str = "http://gateway:8100/v1", **changes: Any
) -> EpisodeRequest:
    fields = {"episode_id": "e1", "task": task, "base_url": base_url, "api_key": KEY,
              "model": "policy", "deadline_seconds": WAIT} | changes  # fmt: skip
    return EpisodeRequest(**fields)


def client_of(urls: list[str], **options: Any) -> AgentClient:
    async def dns(url: str) -> list[str]:  # the headless Service's answer
        return urls

    return AgentClient("http://job-agent-coder:8000", name="coder", resolve=dns, **options)


def episode(urls: list[str], task: dict[str, Any], **changes: Any) -> EpisodeResult:
    async def scenario() -> EpisodeResult:
        async with client_of(urls) as agents:
            return await agents.run(request(task, **changes))

    return asyncio.run(scenario())


def failure(urls: list[str], task: dict[str, Any], **changes: Any) -> AgentEpisodeFailed:
    with pytest.raises(AgentEpisodeFailed) as failed:
        episode(urls, task, **changes)
    assert failed.value.reason in AGENT_CUT_REASONS
    assert failed.value.cut.startswith(f"{failed.value.reason}: agent 'coder' episode at ")
    return failed.value


# --- agents ---


async def rewarded(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    assert isinstance(client, openai.AsyncOpenAI) and client.api_key == KEY
    assert str(client.base_url) == "http://gateway:8100/v1/"
    return float(task["reward"])


async def undecided(task: dict[str, Any], client: openai.AsyncOpenAI) -> None:
    return None


async def reporting(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> EpisodeResult:
    return EpisodeResult(reward=0.5, info={"steps": 3.0, "model_is_policy": model == "policy"})


async def failing(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    raise ValueError(f"no tool for {task['key']}")


async def wordy(task: dict[str, Any], client: openai.AsyncOpenAI) -> Any:
    return task["returns"]


POOLS: list[Any] = []  # the HTTP client under each episode's openai client, in order


async def pooled(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    POOLS.append(client._client)
    return 1.0


def hanging(cancelled: threading.Event) -> Any:
    async def hang(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
        try:
            await asyncio.Event().wait()  # never set: only the deadline ends it
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1.0

    return hang


@dataclass
class Gate:
    """Holds an agent's episodes whose task asks it to, until released."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def agent(self, reward: float) -> Any:
        async def held(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
            if task.get("hold"):
                self.entered.set()
                await asyncio.to_thread(self.release.wait, WAIT)
            return reward

        return held


@pytest.fixture()
def agents() -> Iterator[str]:
    apps = {name: app_for_agent(run) for name, run in
            [("rewarded", rewarded), ("undecided", undecided), ("reporting", reporting),
             ("failing", failing), ("wordy", wordy), ("pooled", pooled)]}  # fmt: skip
    with served(apps) as url:
        yield url


# --- an episode's result ---


def test_the_agents_reward_comes_back(agents: str) -> None:
    assert episode([f"{agents}/rewarded"], {"reward": 0.75}) == EpisodeResult(reward=0.75)


def test_every_episode_shares_one_open_connection_pool(agents: str) -> None:
    POOLS.clear()
    for _ in range(2):
        assert episode([f"{agents}/pooled"], {}) == EpisodeResult(reward=1.0)
    first, second = POOLS
    assert first is second and not first.is_closed


def test_an_agent_that_returns_none_leaves_the_reward_to_the_job(agents: str) -> None:
    assert episode([f"{agents}/undecided"], {}) == EpisodeResult(reward=None)


def test_an_agent_may_report_numbers_and_take_the_served_model_name(agents: str) -> None:
    result = episode([f"{agents}/reporting"], {})
    assert result == EpisodeResult(reward=0.5, info={"steps": 3.0, "model_is_policy": 1.0})


def test_an_agent_that_raises_is_agent_error_naming_the_function_and_never_the_key(
    agents: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    failed = failure([f"{agents}/failing"], {"key": "c"})
    assert failed.reason == "agent_error" and failed.failed.status == 500
    assert "tests.unit.test_agent_adapter:failing raised ValueError: no tool for c" in str(failed)
    assert "failing raised" in caplog.text  # the server logged it, with its traceback
    assert KEY not in caplog.text and KEY not in str(failed)


@pytest.mark.parametrize(
    ("returns", "why"),
    [("yes", "returned a str: expected a float, None or an EpisodeResult"),
     (True, "returned a bool"), ({"reward": 1}, "returned a dict")],
)  # fmt: skip
def test_an_agent_that_returns_something_else_is_agent_error_saying_what(
    agents: str, returns: Any, why: str
) -> None:
    failed = failure([f"{agents}/wordy"], {"returns": returns})
    assert failed.reason == "agent_error" and why in str(failed)


def test_a_body_that_breaks_the_protocol_is_a_422_naming_the_field_without_the_key(
    agents: str,
) -> None:
    body = request({}).model_dump(mode="json")
    missing = {k: v for k, v in body.items() if k != "deadline_seconds"}
    for sent, field_name, expected in [
        (missing, "deadline_seconds", "Field required"),
        (body | {"deadline_seconds": 0}, "deadline_seconds", "greater than 0"),
        (body | {"reward": 1}, "reward", "Extra inputs are not permitted"),
    ]:
        answer = httpx.post(f"{agents}/rewarded/episodes", json=sent, timeout=WAIT)
        assert answer.status_code == 422, answer.text
        [problem] = answer.json()["detail"]
        assert problem["loc"] == ["body", field_name] and expected in problem["msg"]
        assert KEY not in answer.text  # FastAPI's own answer would echo the body


def test_only_async_functions_serve() -> None:
    def plain(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
        return 1.0

    with pytest.raises(NotAnAgent, match="plain is not an async function"):
        app_for_agent(plain)  # type: ignore[arg-type]


def test_a_function_that_cannot_serve_fails_the_local_agent_naming_it() -> None:
    with (
        pytest.raises(EnvironmentDidNotStart) as failed,
        served_locally("rlhf_env.toys:first_word", command="agent"),
    ):
        pass
    assert "the agent rlhf_env.toys:first_word exited with status 2" in str(failed.value)
    assert "rlhf_env.toys:first_word is not an async function" in str(failed.value)


def test_serving_environments_does_not_import_openai() -> None:
    """The environment image has no openai: only `python -m rlhf_env agent` needs it."""
    check = ("import sys, rlhf_env.__main__, rlhf_env.process, rlhf_env.replicas; "
             "assert 'openai' not in sys.modules, 'openai imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", check], check=True, timeout=WAIT * 6)


# --- deadlines ---


def test_an_agent_past_its_deadline_is_cancelled_and_the_episode_is_agent_timeout() -> None:
    cancelled = threading.Event()
    with served({"hang": app_for_agent(hanging(cancelled))}) as url:
        failed = failure([f"{url}/hang"], {}, deadline_seconds=0.5)
        assert cancelled.is_set()  # the run was cancelled before the 504 was sent
    assert failed.reason == "agent_timeout" and failed.failed.status == 504
    assert "ran past the episode's 0.5 s deadline; cancelled" in str(failed)


def test_an_agent_that_never_answers_is_cut_at_the_deadline_and_grace() -> None:
    hung = FastAPI()  # an agent of another make that ignores its deadline

    @hung.post("/episodes")
    async def never(request: Request) -> None:
        await asyncio.Event().wait()

    with served({"hung": hung}) as url:

        async def scenario() -> None:
            async with client_of([f"{url}/hung"], grace_seconds=0.2) as agents:
                await agents.run(request({}, deadline_seconds=0.2))

        with pytest.raises(AgentEpisodeFailed) as failed:
            asyncio.run(scenario())
    assert failed.value.reason == "agent_timeout"
    assert "no answer within 0.4 s" in str(failed.value)


# --- replicas, and the limit of episodes at once ---


def test_an_episode_a_full_replica_refuses_is_run_on_another() -> None:
    gate = Gate()
    apps = {"a": app_for_agent(gate.agent(1.0), max_episodes=1),
            "b": app_for_agent(gate.agent(2.0), max_episodes=1)}  # fmt: skip
    with served(apps) as url:
        first, second = f"{url}/a", f"{url}/b"

        async def scenario() -> tuple[EpisodeResult, EpisodeResult]:
            async with client_of([first]) as other_trainer, client_of([first, second]) as agents:
                holding = asyncio.create_task(other_trainer.run(request({"hold": True})))
                assert await asyncio.to_thread(gate.entered.wait, WAIT)  # `a` is full now
                refused = httpx.post(
                    f"{first}/episodes", json=request({}).model_dump(mode="json"), timeout=WAIT
                )
                assert refused.status_code == 503 and "most this agent runs" in refused.text
                moved = await agents.run(request({}))  # `a` first (fewest here): refused
                gate.release.set()
                return moved, await holding

        moved, held = asyncio.run(scenario())
    assert moved.reward == 2.0 and held.reward == 1.0


def test_an_episode_on_a_replica_that_is_gone_is_run_on_another(agents: str) -> None:
    assert episode([GONE, f"{agents}/rewarded"], {"reward": 1.0}).reward == 1.0


async def killed_at_its_call(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """Calls the gateway with its process id: the killing stand-in kills it there."""
    messages: list[Any] = [{"role": "user", "content": "c"}]
    pid = {"x-agent-pid": str(os.getpid())}
    await client.chat.completions.create(model="policy", messages=messages, extra_headers=pid)
    return 1.0


def test_an_agent_killed_mid_episode_is_agent_unreachable_and_its_client_goes_on(
    agents: str,
) -> None:
    """The agent's process is killed (SIGKILL, as a pod's container is) at its first call
    to the gateway, an event: the episode in flight is cut, named; the next one runs."""
    killed: list[int] = []
    killer = FastAPI()

    @killer.post("/v1/chat/completions")
    async def kill(request: Request) -> JSONResponse:
        killed.append(int(request.headers["x-agent-pid"]))
        os.kill(killed[-1], signal.SIGKILL)
        return JSONResponse({"error": "killed"}, status_code=500)

    async def scenario(dying: str, url: str) -> tuple[AgentEpisodeFailed, EpisodeResult]:
        async with client_of([dying]) as dies, client_of([f"{agents}/rewarded"]) as lives:
            with pytest.raises(AgentEpisodeFailed) as failed:
                await dies.run(request({}, base_url=f"{url}/gateway/v1"))
            return failed.value, await lives.run(request({"reward": 0.5}))

    target = f"{__name__}:killed_at_its_call"
    with served({"gateway": killer}) as url, served_locally(target, command="agent") as dying:
        failed, next_episode = asyncio.run(scenario(dying, url))
    assert len(killed) == 1
    assert failed.reason == "agent_unreachable", failed
    assert failed.cut.startswith("agent_unreachable: agent 'coder' episode at "), failed.cut
    assert next_episode == EpisodeResult(reward=0.5)


def test_with_every_replica_gone_the_episode_is_agent_unreachable() -> None:
    failed = failure([GONE, "http://127.0.0.1:10"], {})
    assert failed.reason == "agent_unreachable" and "ConnectError" in str(failed)


def test_episodes_past_the_clients_limit_wait_for_one_to_end() -> None:
    gate = Gate()
    with served({"a": app_for_agent(gate.agent(1.0))}) as url:

        async def scenario() -> tuple[list[EpisodeResult], int]:
            async with client_of([f"{url}/a"], max_concurrent_episodes=1) as agents:
                held = asyncio.create_task(agents.run(request({"hold": True})))
                waiting = asyncio.create_task(agents.run(request({})))
                assert await asyncio.to_thread(gate.entered.wait, WAIT)
                health = await agents.health()
                gate.release.set()
                return list(await asyncio.gather(held, waiting)), health.sessions

        results, running = asyncio.run(scenario())
    assert running == 1  # the second episode waited in the client: the agent ran one
    assert [r.reward for r in results] == [1.0, 1.0]


def test_a_client_of_an_agents_entry_takes_its_engines_share() -> None:
    agent = AgentConfig(name="coder", url="http://coder:8000", max_concurrent_episodes=5)
    client = AgentClient.of(agent, engines=2)
    assert client.replicas.url == "http://coder:8000" and client._slots._value == 3
    served_here = AgentConfig(name="coder", serve="agents.coder:run")
    assert AgentClient.of(served_here, "http://127.0.0.1:8123").replicas.url.endswith(":8123")
    with pytest.raises(ValueError, match=r"agents\[coder\] has no url"):
        AgentClient.of(served_here)


def test_a_server_that_does_not_speak_the_protocol_is_agent_protocol() -> None:
    odd = FastAPI()

    @odd.post("/episodes")
    async def answer() -> dict[str, str]:
        return {"reward": "high"}

    with served({"environment": app_for(Lookup), "odd": odd}) as url:
        not_an_agent = failure([f"{url}/environment"], {})
        breaks = failure([f"{url}/odd"], {})
    assert not_an_agent.reason == "agent_protocol" and not_an_agent.failed.status == 404
    assert breaks.reason == "agent_protocol" and "reward" in str(breaks)


# --- the example agent, against a stand-in gateway ---


@dataclass
class StandInGateway:
    """A stand-in for the gateway: answers each chat completion with the next scripted
    assistant message and records what it was sent (its body, its Authorization)."""

    replies: list[dict[str, Any]]
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.calls.append((request.headers.get("authorization", ""), body))
            message = self.replies.pop(0)
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            return {"id": f"chatcmpl-{len(self.calls)}", "object": "chat.completion",
                    "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}]}  # fmt: skip

        return app


def calls_lookup(key: str) -> dict[str, Any]:
    call = {"id": f"call_{key}", "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"key": key})}}  # fmt: skip
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def says(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_the_example_agent_served_as_a_local_run_serves_it_plays_an_episode() -> None:
    task = {"key": "c", "value": "x"}
    gateway = StandInGateway([calls_lookup("c"), says("x")])
    with (
        served({"gateway": gateway.app()}) as url,
        served_locally(
            "examples.agents.letters_agent:run", ["--max-episodes", "2"], command="agent"
        ) as agent,
    ):
        result = episode([agent], task, base_url=f"{url}/gateway/v1")
    assert result == EpisodeResult(reward=1.0)
    (auth, first), (_, second) = gateway.calls
    assert auth == f"Bearer {KEY}" and first["model"] == "policy"
    assert [t["function"]["name"] for t in first["tools"]] == ["lookup"]
    assert first["messages"] == [{"role": "user", "content": "c"}]
    assistant, answer = second["messages"][1:]
    assert assistant["tool_calls"][0]["function"]["arguments"] == '{"key": "c"}'
    assert answer == {"role": "tool", "tool_call_id": "call_c", "content": "x"}


@pytest.mark.parametrize(
    "replies",
    [[says("x")], [calls_lookup("d"), says("x")], [calls_lookup("c"), says("y")],
     [calls_lookup("c"), says("x y")], [calls_lookup("c"), calls_lookup("c")]],
    ids=["no-lookup", "other-key", "wrong-answer", "right", "no-answer"],
)  # fmt: skip
def test_the_example_agent_grades_as_the_trainer_driven_task_scores(
    replies: list[dict[str, Any]],
) -> None:
    task = {"key": "c", "value": "x"}
    gateway = StandInGateway(list(replies))
    with served({"gateway": gateway.app()}) as url:

        async def scenario() -> float:
            base_url = f"{url}/gateway/v1"
            async with openai.AsyncOpenAI(base_url=base_url, api_key=KEY) as client:
                return await letters_agent.run(task, client, "policy")

        reward = asyncio.run(scenario())
    assert reward == letter_lookup_score(task, replies)


def letter_lookup_score(task: dict[str, Any], replies: list[dict[str, Any]]) -> float:
    """rlhf_env.toys.LetterLookup's score for the same turns; 0 when they end without an
    answer (a max_turns cut of a trainer-driven episode, trained with score 0)."""
    environment = LetterLookup()
    environment.reset(task)
    for reply in replies:
        if environment.step(Message.model_validate(reply)).done:
            return environment.score()
    return 0.0
