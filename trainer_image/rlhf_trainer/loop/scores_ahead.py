"""Fully async with a reward service (models.reward.url): samples scored as they finish.

A thread of the driver reads each sample as it reaches the queue (`SampleQueue.arrivals`)
and has the reward service score it, so that by the time the trainer takes a batch its
rewards are in, and a slow service costs the loop only what it is behind, not a whole
round trip per step. The thread runs one event loop: what each read of the queue brings
is scored by a task of it, in requests the client sizes, with at most `concurrency` in
flight across the tasks, as the job's models.reward.requests allows, over one HTTP
client whose connections are kept from read to read (no new handshake each time). The
scores are kept by sample uid until the step takes them. Nothing is checkpointed: a
resumed queue's samples arrive again, and are scored again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import torch

from rlhf_env.rewards import RewardClient, ScoredSample
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.groups import join
from rlhf_trainer.loop.rewards import service_rewards
from rlhf_trainer.rollout.queue import Sample

log = logging.getLogger(__name__)

ARRIVALS_WAIT_S = 1.0  # how long one read of the queue waits for a sample (and a stop)
ToScored = Callable[[Sequence[Sample]], list[ScoredSample]]  # what the service is sent
Scored = Callable[[float, float], object]  # (start, end) of a read's scoring, for the timeline


def scores_ahead(config: JobConfig) -> bool:
    """Whether the job scores samples as they finish: fully async, a reward service."""
    return config.async_ is not None and config.models.reward.url is not None


class ScoresAhead:
    """Scores the queue's samples as they arrive; `take` hands their rewards out."""

    def __init__(
        self, queue: Any, client: RewardClient, to_scored: ToScored, on_scored: Scored
    ) -> None:
        self.queue = queue
        self.client = client
        self.to_scored = to_scored
        self.on_scored = on_scored
        self._scores: dict[int, float] = {}  # by uid, scored and not taken yet
        self._ready = threading.Condition()
        self._failure: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._serve()), name="scores-ahead", daemon=True
        )

    def start(self) -> ScoresAhead:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=60)

    async def _serve(self) -> None:
        slots = asyncio.Semaphore(self.client.concurrency)
        scoring: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references
        read = 0  # samples read from the queue so far
        # One HTTP client for the whole run: its connections are kept from read to read.
        async with self.client.connection() as http:
            try:
                while not self._stopping.is_set():
                    arrived, read = await asyncio.to_thread(self._arrivals, read)
                    if arrived:
                        task = asyncio.create_task(self._score(http, slots, arrived))
                        scoring.add(task)
                        task.add_done_callback(scoring.discard)
            except BaseException as error:
                self._fail(error)
            for task in scoring:
                task.cancel()
            await asyncio.gather(*scoring, return_exceptions=True)  # before the client closes

    def _arrivals(self, read: int) -> tuple[list[Sample], int]:
        arrived: tuple[list[Sample], int] = join(
            [self.queue.arrivals.remote(read, ARRIVALS_WAIT_S)]
        )[0]
        return arrived

    async def _score(
        self, http: httpx.AsyncClient, slots: asyncio.Semaphore, samples: Sequence[Sample]
    ) -> None:
        started = time.time()
        try:
            scored = self.to_scored(samples)
            rewards = service_rewards(await self.client.score_each(scored, slots=slots, http=http))
        except Exception as error:
            self._fail(error)
            return
        self.on_scored(started, time.time())
        with self._ready:
            self._scores.update(zip((s.uid for s in samples), rewards.tolist(), strict=True))
            self._ready.notify_all()

    def _fail(self, error: BaseException) -> None:
        log.error("scoring the samples as they finish failed: %r", error)
        with self._ready:
            self._failure = error
            self._ready.notify_all()

    def take(self, samples: Sequence[Sample]) -> torch.Tensor:
        """(B,) the samples' rewards, once each is scored (NaN: the service failed it)."""
        uids = [s.uid for s in samples]
        with self._ready:
            self._ready.wait_for(
                lambda: self._failure is not None or all(u in self._scores for u in uids)
            )
            if self._failure is not None:
                raise RuntimeError("scoring the samples as they finish failed") from self._failure
            return torch.tensor([self._scores.pop(uid) for uid in uids])
