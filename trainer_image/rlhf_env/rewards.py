"""Rewards as a service: a remote scorer the trainer calls in batches (`models.reward.url`).

    POST /score   {"samples": [{"prompt": "...", "response": "...", "row": {...}}, ...]}
               -> {"rewards": [0.5, ...]}          one finite number per sample, in order
    GET  /healthz                                   -> {"status": "ok", "scorer": "..."}

`reward_app_for(score)` serves a plain function `score(prompt, response, **row) ->
float`, the same signature as a rule-based reward in the trainer image, so a reward that
outgrew the image moves out unchanged: `python -m rlhf_env serve-reward module:function`.

`RewardClient` is the trainer's side. It spreads a call's samples over `concurrency`
requests at once, `batch_size` samples a request at most, so that a step's samples are
scored side by side rather than queued in one request. A request that times out, cannot
connect, or gets a 5xx or a 429 is retried `retries` times with exponential backoff;
anything else (a 4xx, an answer that breaks the protocol, a count that does not match)
fails at once. Every failure is one `RewardServiceFailed` that names the URL and the
reason; `score_each` leaves a failed batch's samples unscored (None) instead, and
scores the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import certifi
import httpx
from fastapi import FastAPI, HTTPException
from pydantic import Field, ValidationError

from rlhf_env.client import KEEPALIVE_SECONDS
from rlhf_env.protocol import ProtocolModel, describe

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
BACKOFF_SECONDS = 0.5  # before the first retry; doubled before each next one


class ScoredSample(ProtocolModel):
    prompt: str  # the prompt's text (a chat prompt rendered through its template)
    response: str  # the response's text, special tokens kept
    row: dict[str, Any] = Field(default_factory=dict)  # the dataset row's other columns


class ScoreRequest(ProtocolModel):
    samples: list[ScoredSample] = Field(min_length=1)


class Rewards(ProtocolModel):
    # A NaN or infinite reward would poison every gradient it touches: refused here.
    rewards: list[Annotated[float, Field(allow_inf_nan=False)]]


class RewardServiceFailed(Exception):
    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"reward service at {url} failed: {reason}")


class RewardClient:
    """Scores samples at one reward service (see the module doc for the policy)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        concurrency: int = 8,
        batch_size: int = 64,
        backoff: float = BACKOFF_SECONDS,
    ) -> None:
        self.url = url.rstrip("/") + "/score"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.batch_size, self.concurrency = batch_size, concurrency
        # Made once: httpx builds one per client by default, 50 ms of CPU each here,
        # and a call not given a connection opens a client of its own.
        self.tls = ssl.create_default_context(cafile=certifi.where())

    async def score(self, samples: Sequence[ScoredSample]) -> list[float]:
        """One reward per sample, in order; RewardServiceFailed if any batch failed."""
        rewards = await self.score_each(samples, partial=False)
        return [reward for reward in rewards if reward is not None]

    def connection(self) -> httpx.AsyncClient:
        """An HTTP client for the service, to open with `async with`: the calls given it
        (`score_each(..., http=)`) reuse its connections rather than each open its own."""
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_SECONDS)  # retries come after idle
        return httpx.AsyncClient(timeout=None, limits=limits, verify=self.tls)

    async def score_each(
        self,
        samples: Sequence[ScoredSample],
        *,
        partial: bool = True,
        slots: asyncio.Semaphore | None = None,
        http: httpx.AsyncClient | None = None,
        size: int | None = None,
    ) -> list[float | None]:
        """One reward per sample, in order. `partial`: a batch that fails (after its
        retries) is None for each of its samples, logged naming the URL and the reason,
        and the others are still scored; else its failure is raised. `slots`: the
        requests in flight, shared by calls that overlap (one for this call if None).
        `http`: an open `connection()` (one for this call if None). `size`: samples a
        request (`request_size` if None)."""
        size = size or self.request_size(len(samples))
        batches = [samples[start : start + size] for start in range(0, len(samples), size)]
        if slots is None:
            slots = asyncio.Semaphore(self.concurrency)  # of this call's loop
        async with contextlib.AsyncExitStack() as stack:
            if http is None:
                http = await stack.enter_async_context(self.connection())
            scored = await asyncio.gather(
                *(self._score_batch(http, slots, b) for b in batches), return_exceptions=partial
            )
        rewards: list[float | None] = []
        for batch, result in zip(batches, scored, strict=True):
            if isinstance(result, RewardServiceFailed):
                log.error("%s: %d samples left unscored", result, len(batch))
                rewards += [None] * len(batch)
            elif isinstance(result, BaseException):
                raise result
            else:
                rewards += result
        return rewards

    def request_size(self, samples: int) -> int:
        """Samples a request: spread over `concurrency` requests, `batch_size` at most."""
        return max(1, min(self.batch_size, math.ceil(samples / self.concurrency)))

    async def _score_batch(
        self, http: httpx.AsyncClient, slots: asyncio.Semaphore, batch: Sequence[ScoredSample]
    ) -> list[float]:
        body = ScoreRequest(samples=list(batch)).model_dump(mode="json")
        for attempt in range(self.retries + 1):
            async with slots:
                retry_reason = await self._try(http, body, len(batch))
            if isinstance(retry_reason, list):
                return retry_reason
            if attempt == self.retries:
                raise RewardServiceFailed(
                    self.url, f"{retry_reason} (after {self.retries + 1} attempts)"
                )
            delay = self.backoff * 2**attempt
            log.warning("reward service at %s: %s; trying again in %.1f s", self.url,
                        retry_reason, delay)  # fmt: skip
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _try(
        self, http: httpx.AsyncClient, body: dict[str, Any], expected: int
    ) -> list[float] | str:
        """The batch's rewards, or why it is worth trying again (raises when it is not)."""
        try:
            async with asyncio.timeout(self.timeout):
                response = await http.post(self.url, json=body)
        except TimeoutError:
            return f"no answer within {self.timeout:g} s"
        except httpx.HTTPError as error:
            return f"{type(error).__name__}: {error or 'no detail'}"
        if response.status_code in RETRY_STATUSES:
            return f"HTTP {response.status_code}: {response.text[:300]}"
        if not response.is_success:
            raise RewardServiceFailed(
                self.url, f"HTTP {response.status_code}: {response.text[:500]}"
            )
        try:
            rewards = Rewards.model_validate_json(response.content).rewards
        except ValidationError as error:
            raise RewardServiceFailed(
                self.url, f"the answer breaks the protocol: {describe(error)}"
            ) from error
        if len(rewards) != expected:
            raise RewardServiceFailed(self.url, f"{len(rewards)} rewards for {expected} samples")
        return rewards


Scorer = Callable[..., float]  # (prompt, response, **row) -> reward


def reward_app_for(score: Scorer) -> FastAPI:
    """An ASGI app serving `score` behind the protocol; it runs in a worker thread, a
    sample at a time, and a failure is a 500 naming the function and the error."""
    name = getattr(score, "__qualname__", repr(score))
    app = FastAPI(title=f"{name} reward")

    @app.post("/score")
    async def score_samples(request: ScoreRequest) -> Rewards:
        def score_all() -> list[float]:
            return [float(score(s.prompt, s.response, **s.row)) for s in request.samples]

        try:
            return Rewards(rewards=await asyncio.to_thread(score_all))
        except Exception as error:  # the user's function: its error is the answer
            raise HTTPException(500, f"{name} raised {type(error).__name__}: {error}") from error

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "scorer": name}

    return app
