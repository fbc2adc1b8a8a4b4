"""Sessions over an environment's replicas: spread by open sessions, and an episode whose
replica dies mid-session started again on another (rlhf_env.replicas, EpisodeRunner).

Each replica is a real server process (`python -m rlhf_env serve`, as a local run starts
one). The headless Service's DNS answer is the one stand-in: a resolver that returns the
two replicas' URLs (they differ by port here, by address in a cluster). The replica
dies on an event, at its episode's second step (tests.environments.Replica), by SIGKILL.
A session's start that a replica refuses (nothing listens, or it holds its most sessions
while another client holds one open) is made on the other; with all full, it waits for
room.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from rlhf_env.client import EnvironmentClient
from rlhf_env.process import answers, served_locally
from rlhf_env.replicas import EnvironmentReplicas, resolve_replicas
from rlhf_env.server import app_for
from rlhf_env.toys import Lookup
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.sections import ModelSource, TinyModel
from rlhf_trainer.models import chat_tokenizer
from rlhf_trainer.rollout.episodes import EpisodeLimits, EpisodeRunner
from rlhf_trainer.rollout.trajectory import ChatRenderer
from tests.environments import CHATTER_TURNS, served

LIMITS = EpisodeLimits(
    max_turns=CHATTER_TURNS, max_tokens=64, turn_tokens=4, call_seconds=10,
    turn_seconds=10, episode_seconds=60,
)  # fmt: skip


@pytest.fixture()
def replicas() -> Iterator[list[str]]:
    with (
        served_locally("tests.environments:Replica") as first,
        served_locally("tests.environments:Replica") as second,
    ):
        yield [first, second]


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(chat_tokenizer(ModelSource(tiny=TinyModel(vocab_size=64))), "tiny")


def runner(urls: list[str], renderer: ChatRenderer) -> EpisodeRunner:
    async def dns(url: str) -> list[str]:  # the headless Service's answer
        return urls

    replicas = EnvironmentReplicas("http://job-env-replica:8000", resolve=dns)
    return EpisodeRunner(replicas, renderer, "rlhf_toy", LIMITS)


def says(renderer: ChatRenderer, text: str = "a </s>") -> Any:
    """A turn as an engine returns it: the words of `text`, sampled, finished."""
    ids = renderer.tokenizer.encode(text, add_special_tokens=False)

    async def turn(prompt: list[int], max_tokens: int) -> Rollout:
        return Rollout(prompt, ids, [-0.5] * len(ids), finished=True, policy_version=3)

    return turn


def play(
    runner: EpisodeRunner, rows: list[dict[str, Any]], renderer: ChatRenderer
) -> list[Rollout]:
    async def scenario() -> list[Rollout]:
        rollouts = await asyncio.gather(*(runner.run(row, says(renderer), 3) for row in rows))
        await runner.replicas.aclose()
        return list(rollouts)

    return asyncio.run(scenario())


def test_sessions_spread_over_the_replicas_by_open_sessions(
    replicas: list[str], renderer: ChatRenderer
) -> None:
    rollouts = play(runner(replicas, renderer), [{"key": "a"}] * 4, renderer)
    pids = [r.episode.score for r in rollouts if r.episode is not None]
    assert len(pids) == 4 and len(set(pids)) == 2
    assert pids.count(pids[0]) == 2  # two episodes each, played at once
    assert all(r.episode is not None and r.episode.cut is None for r in rollouts)


def test_an_episode_whose_replica_dies_starts_again_on_another_and_is_counted(
    replicas: list[str], renderer: ChatRenderer, tmp_path: Path
) -> None:
    row = {"key": "a", "die_once": str(tmp_path / "died")}
    [rollout] = play(runner(replicas, renderer), [row], renderer)
    assert (tmp_path / "died").exists()  # a replica died at the episode's second step
    episode = rollout.episode
    assert episode is not None and episode.cut is None, episode
    assert episode.restarts == 1 and episode.turns == CHATTER_TURNS
    answering = [url for url in replicas if answers(url)]
    assert len(answering) == 1  # one replica is gone: the other played the episode to its end
    os.kill(int(episode.score), 0)  # its score is the process id of a live replica
    assert sum(rollout.loss_mask) > 0  # trained on: the restarted episode, whole


def test_with_every_replica_gone_the_episode_is_cut_naming_the_last(
    renderer: ChatRenderer,
) -> None:
    gone = ["http://127.0.0.1:9", "http://127.0.0.1:10"]  # nothing listens
    [rollout] = play(runner(gone, renderer), [{"key": "a"}], renderer)
    # Its start was made on the second when the first refused the connection: no episode
    # was played, so none is restarted.
    assert rollout.episode is not None and rollout.episode.restarts == 0
    cut = rollout.episode.cut or ""
    assert cut.startswith("environment_unreachable: environment start at http://127.0.0.1:10/")
    assert "ConnectError" in cut and sum(rollout.loss_mask) == 0


def test_replicas_added_while_the_job_runs_take_the_next_sessions() -> None:
    answer = ["http://10.0.0.1:8000"]

    async def dns(url: str) -> list[str]:
        return answer

    async def scenario() -> list[str]:
        replicas = EnvironmentReplicas("http://env:8000", resolve=dns, resolve_seconds=0)
        async with replicas.session() as first:
            answer.append("http://10.0.0.2:8000")  # scaled to 2
            async with replicas.session() as second, replicas.session() as third:
                picked = [first.url, second.url, third.url]
        replicas.mark_down("http://10.0.0.2:8000")
        async with replicas.session() as fourth, replicas.session() as fifth:
            picked += [fourth.url, fifth.url]  # the one down is left while another is up
        answer.remove("http://10.0.0.2:8000")  # its pod went: its client is closed
        async with replicas.session():
            assert second.is_closed and not first.is_closed
        await replicas.aclose()
        return picked

    one, two = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    assert asyncio.run(scenario()) == [one, two, one, one, one]


def test_a_headless_services_name_resolves_to_one_url_per_address() -> None:
    async def resolved(url: str) -> list[str]:
        return await resolve_replicas(url)

    assert asyncio.run(resolved("http://localhost:8000/env")) == ["http://127.0.0.1:8000/env"]
    assert asyncio.run(resolved("https://tools.example:8443")) == ["https://tools.example:8443"]
    assert asyncio.run(resolved("http://name.invalid:80")) == ["http://name.invalid:80"]


# --- a start that a replica refuses (no connection, or 503: full) is made on another ---

ROW = {"table": {"a": "b"}, "key": "a"}
WAIT = 10.0  # what a test waits, at most, for a thing it caused


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

    placed, counts = asyncio.run(scenario())
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

    assert asyncio.run(scenario())


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

    assert asyncio.run(scenario()) == (free, True)
