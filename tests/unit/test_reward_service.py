"""Rewards as a service (models.reward.url) over real HTTP: a uvicorn server in a thread
serves reward functions and misbehaving scorers; the trainer's RewardClient batches,
bounds its requests in flight, retries what may pass, and names the URL when it fails."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, HTTPException, Request

from rlhf_env.__main__ import main
from rlhf_env.rewards import (
    RewardClient,
    RewardServiceFailed,
    ScoredSample,
    ScoreRequest,
    reward_app_for,
)
from rlhf_operator.api.validation import InvalidJob, parse_spec
from tests.environments import served


def length_reward(prompt: str, response: str, answer: str = "") -> float:
    """The response's words, plus 10 when it says the row's answer."""
    return len(response.split()) + (10.0 if answer and answer in response else 0.0)


def broken_reward(prompt: str, response: str, **row: str) -> float:
    raise ValueError("no answer column")


def picky_reward(prompt: str, response: str, **row: str) -> float:
    """The response's words; fails on a row that asks it to."""
    if row.get("fail"):
        raise ValueError("asked to fail")
    return float(len(response.split()))


GATHER_SECONDS = 5.0


class Scorer:
    """A hand-made scorer that counts its requests and how many ran at once. With
    `gather`, requests are held until that many have been in flight at once (or
    GATHER_SECONDS pass), and no longer after: how many run at once is then the
    client's limit, not the timing of their arrival or of the last ones' (a tail of
    fewer requests is never held)."""

    def __init__(self, fail_first: int = 0, status: int = 503, gather: int = 0) -> None:
        self.fail_first, self.status, self.gather = fail_first, status, gather
        self.requests, self.running, self.most_running = 0, 0, 0
        self.sizes: list[int] = []  # samples of each request, as they came
        self.ports: list[int] = []  # the client's port of each request: its connection
        self.lock = threading.Lock()

    def app(self, rewards: Any = None) -> FastAPI:
        app = FastAPI()

        @app.post("/score")
        async def score(request: ScoreRequest, http: Request) -> dict[str, Any]:
            with self.lock:
                self.requests += 1
                self.sizes.append(len(request.samples))
                self.ports.append(http.client.port if http.client else 0)
                self.running += 1
                self.most_running = max(self.most_running, self.running)
                failing = self.requests <= self.fail_first
            try:
                held_until = time.monotonic() + GATHER_SECONDS
                while self.most_running < self.gather and time.monotonic() < held_until:
                    await asyncio.sleep(0.01)
                if failing:
                    raise HTTPException(self.status, "not now")
                given = [len(s.response) for s in request.samples] if rewards is None else rewards
                return {"rewards": given}
            finally:
                with self.lock:
                    self.running -= 1

        return app


SCORERS = {
    "flaky": Scorer(fail_first=2),
    "refusing": Scorer(fail_first=100, status=403),
    "slow": Scorer(gather=3),
    "hanging": Scorer(gather=2),  # its one request is held: it never answers in time
    "spread": Scorer(gather=4),
    "short": Scorer(),
    "kept": Scorer(),
    "nan": Scorer(),
}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    apps = {
        "length": reward_app_for(length_reward),
        "broken": reward_app_for(broken_reward),
        "picky": reward_app_for(picky_reward),
        "short": SCORERS["short"].app(rewards=[1.0]),
        "nan": SCORERS["nan"].app(rewards=[float("nan")]),
        **{
            name: SCORERS[name].app()
            for name in ("flaky", "refusing", "slow", "hanging", "spread", "kept")
        },
    }
    with served(apps) as url:
        yield url


def samples(count: int) -> list[ScoredSample]:
    return [ScoredSample(prompt="q", response="a " * i, row={"answer": "7"}) for i in range(count)]


def score(url: str, batch: list[ScoredSample], **options: Any) -> list[float]:
    return asyncio.run(RewardClient(url, backoff=0.01, **options).score(batch))


def test_a_reward_function_is_served_in_batches_and_answers_in_order(server: str) -> None:
    batch = [*samples(130), ScoredSample(prompt="q", response="it is 7", row={"answer": "7"})]
    assert score(f"{server}/length", batch, batch_size=64) == [*range(130), 13.0]


def test_requests_in_flight_are_bounded(server: str) -> None:
    scorer = SCORERS["slow"]
    assert score(f"{server}/slow", samples(12), batch_size=1, concurrency=3) == [
        2.0 * i for i in range(12)
    ]
    assert (scorer.requests, scorer.most_running) == (12, 3)


def test_a_call_is_spread_over_the_requests_it_may_have_in_flight(server: str) -> None:
    """A step's samples go side by side, not queued in one request: 10 samples with room
    for 4 requests are 4 requests of 3 at most, all in flight at once; batchSize still
    caps a request."""
    scorer = SCORERS["spread"]
    assert score(f"{server}/spread", samples(10), batch_size=64, concurrency=4) == [
        2.0 * i for i in range(10)
    ]
    assert (sorted(scorer.sizes), scorer.most_running) == ([1, 3, 3, 3], 4)
    scorer.sizes.clear()
    assert len(score(f"{server}/spread", samples(40), batch_size=5, concurrency=4)) == 40
    assert scorer.sizes == [5] * 8


def test_a_request_that_fails_for_now_is_retried(server: str) -> None:
    assert score(f"{server}/flaky", samples(3), retries=3, concurrency=1) == [0.0, 2.0, 4.0]
    assert SCORERS["flaky"].requests == 3  # two 503s, then the answer


def test_a_service_that_keeps_failing_is_named_with_its_reason(server: str) -> None:
    with pytest.raises(RewardServiceFailed) as failed:
        score(f"{server}/broken", samples(2), retries=1)
    assert str(failed.value) == (
        f"reward service at {server}/broken/score failed: HTTP 500: "
        '{"detail":"broken_reward raised ValueError: no answer column"} (after 2 attempts)'
    )
    with pytest.raises(RewardServiceFailed, match=r"no answer within 0\.05 s \(after 1 attempts\)"):
        score(f"{server}/hanging", samples(1), retries=0, timeout=0.05)
    with pytest.raises(RewardServiceFailed, match="ConnectError"):
        score("http://127.0.0.1:9", samples(1), retries=0)


def test_a_batch_that_fails_leaves_its_samples_unscored_and_the_rest_are_scored(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What the trainer asks (score_each): the samples of the batch the scorer failed
    are None, named in the log with the URL and the reason; the other batches count."""
    batch = [ScoredSample(prompt="q", response="a a", row={"fail": "yes"}) for _ in range(2)]
    batch += samples(3)
    client = RewardClient(f"{server}/picky", backoff=0.01, retries=1, batch_size=2, concurrency=2)
    assert asyncio.run(client.score_each(batch)) == [None, None, 0.0, 1.0, 2.0]
    [logged] = [r.getMessage() for r in caplog.records if "unscored" in r.getMessage()]
    assert logged.startswith(f"reward service at {server}/picky/score failed: HTTP 500")
    assert logged.endswith("(after 2 attempts): 2 samples left unscored")
    gone = RewardClient("http://127.0.0.1:9", retries=0, batch_size=2)
    assert asyncio.run(gone.score_each(samples(3))) == [None, None, None]


def test_answers_that_no_retry_changes_fail_at_once(server: str) -> None:
    with pytest.raises(RewardServiceFailed, match="HTTP 403"):
        score(f"{server}/refusing", samples(1), retries=5)
    assert SCORERS["refusing"].requests == 1
    with pytest.raises(RewardServiceFailed, match="1 rewards for 3 samples"):
        score(f"{server}/short", samples(3), concurrency=1)
    with pytest.raises(RewardServiceFailed, match=r"the answer breaks the protocol: rewards\.0"):
        score(f"{server}/nan", samples(1))


def test_serve_reward_refuses_what_is_not_a_function(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-reward", "rlhf_env.toys:Lookup"]) == 2
    assert capsys.readouterr().err == (
        "python -m rlhf_env serve-reward: rlhf_env.toys:Lookup is a type, expected a function\n"
    )


@pytest.mark.parametrize(
    ("reward", "path", "words"),
    [
        ({"url": "scorer.team.svc:8000"}, "spec.models.reward.url", "should match pattern"),
        ({"function": "toy_copy", "requests": {"retries": 1}}, "spec.models.reward.requests",
         "only with url"),
        ({"url": "http://s:1", "function": "toy_copy"}, "spec.models.reward",
         "set exactly one of path, function, environment or url"),
        ({"url": "http://s:1", "requests": {"concurrency": 0}},
         "spec.models.reward.requests.concurrency", "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_a_bad_reward_service_is_refused_naming_the_field(
    reward: dict[str, Any], path: str, words: str
) -> None:
    import yaml

    from tests.specs import LOCAL_EXAMPLE

    spec = yaml.safe_load(LOCAL_EXAMPLE.read_text())["spec"]
    spec["models"]["reward"] = reward
    with pytest.raises(InvalidJob) as caught:
        parse_spec(spec)
    assert any(e.path == path and words in e.message for e in caught.value.errors), caught.value


def test_steps_in_a_row_with_unscored_samples_fail_the_run_at_the_limit_naming_it() -> None:
    import torch

    from rlhf_trainer.api.reward import RewardSource
    from rlhf_trainer.loop.rewards import UnscoredSteps

    source = RewardSource(url="http://scorer:8000", requests={"maxUnscoredSteps": 2})
    steps = UnscoredSteps(source)
    some, none = torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 0.0])
    assert [steps.count(1, some), steps.count(2, none), steps.count(3, some)] == [1, 0, 1]
    with pytest.raises(RewardServiceFailed) as failed:
        steps.count(4, some)  # the second in a row
    assert str(failed.value) == (
        "reward service at http://scorer:8000 failed: step 4: 2 steps in a row left samples "
        "unscored, 1 of 2 this one (models.reward.requests.maxUnscoredSteps is 2); the log "
        "names each failure"
    )


def test_calls_given_one_connection_reuse_it_and_calls_without_open_their_own(
    server: str,
) -> None:
    """What the fully-async scorer does (loop/scores_ahead.py): every read of the queue
    is scored over the one client it holds, so the service sees one TCP connection."""
    client = RewardClient(f"{server}/kept", concurrency=1)

    async def over_one_connection() -> None:
        async with client.connection() as http:
            for _ in range(3):
                await client.score_each(samples(2), http=http)

    asyncio.run(over_one_connection())
    for _ in range(2):
        asyncio.run(client.score_each(samples(2)))
    shared, own = SCORERS["kept"].ports[:3], SCORERS["kept"].ports[3:]
    assert len(set(shared)) == 1 and len(own) == 2, SCORERS["kept"].ports
    assert len(set(own)) == 2 and not set(own) & set(shared), SCORERS["kept"].ports
