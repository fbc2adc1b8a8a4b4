"""A reward service (models.reward.url) scores samples as they finish, in every mode.

Whoever sees a sample finish offers it here, keyed: the synchronous loop as each rank's
streaming `generate` yields it, fully async as it reaches the queue (`QueueArrivals`,
read on this scorer's own loop). A thread of the driver runs one event loop, which
sends what is offered at once while fewer than models.reward.requests.concurrency
requests are in flight, spread over the free ones and batchSize at most a request, and
otherwise keeps it until a request ends: a fast service sees each sample soon after it
finishes, a slow one sees them in batches as large as it is behind. One HTTP client
serves the run, its connections kept from request to request (no new handshake each
time). The scores are kept by key until the step takes them, after it has started its
pools' scoring stage: so a slow service costs the loop only what it is behind, not a
round trip per step. Nothing is checkpointed: a resumed run's samples arrive again, and
are scored again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from rlhf_env.rewards import RewardClient, ScoredSample
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.rollout.samples import Sample

log = logging.getLogger(__name__)

ARRIVALS_WAIT_S = 1.0  # how long one read of the queue waits for a sample (and a stop)
Keyed = list[tuple[int, ScoredSample]]  # (key, what the service is sent) per sample
Scored = Callable[[float, float], object]  # (start, end) of an offer's scoring, for the timeline


def scores_ahead(config: JobConfig) -> bool:
    """Whether the job's samples are scored as they finish: a reward service scores them."""
    return config.models.reward.url is not None


def service_rewards(rewards: Sequence[float | None]) -> torch.Tensor:
    """(B,) a reward service's answers, NaN for each sample it failed (unscored)."""
    return torch.tensor([math.nan if r is None else r for r in rewards])


class QueueArrivals:
    """Fully async: the samples that reached the queue since the last read, keyed by
    uid; a read waits up to ARRIVALS_WAIT_S for some."""

    def __init__(self, queue: Any, to_scored: Callable[[Sequence[Sample]], list[ScoredSample]]):
        self.queue = queue  # the SampleQueue actor, keeping its arrivals
        self.to_scored = to_scored
        self.read = 0  # samples read so far

    def __call__(self) -> Keyed:
        arrived: list[Sample]
        arrived, self.read = join([self.queue.arrivals.remote(self.read, ARRIVALS_WAIT_S)])[0]
        return list(zip((s.uid for s in arrived), self.to_scored(arrived), strict=True))


class ScoresAhead:
    """Scores what it is offered with the reward service; `take` hands the rewards out."""

    def __init__(self, client: RewardClient, on_scored: Scored) -> None:
        self.client = client
        self.on_scored = on_scored
        self._scores: dict[int, float] = {}  # by key, scored and not taken yet
        self._ready = threading.Condition()
        self._failure: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scores-ahead",
                                        daemon=True)  # fmt: skip
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references
        self._stopped = False
        # One HTTP client for the whole run: its connections are kept from offer to offer.
        self._http = client.connection()
        self._waiting: Keyed = []  # offered, not sent yet (touched on the loop only)
        self._requests = 0  # in flight (on the loop only)

    def start(self) -> ScoresAhead:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Cancel what is still being scored and close the client."""
        if self._stopped or not self._thread.is_alive():
            return
        self._stopped = True
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)

    async def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # before the client closes
        await self._http.aclose()
        await self._loop.shutdown_default_executor()  # a queue read under way ends (≤ 1 s)

    def offer(self, keyed: Keyed) -> None:
        """Score these samples (from any thread); returns at once."""
        if keyed:
            self._loop.call_soon_threadsafe(self._add, keyed)

    def feed_from(self, read: Callable[[], Keyed]) -> None:
        """Also score what `read()` returns (it waits a while for some), read after read,
        until stopped."""

        async def read_all() -> None:
            try:
                while True:
                    if keyed := await asyncio.to_thread(read):
                        self._add(keyed)
            except Exception as error:
                self._fail(error)

        self._loop.call_soon_threadsafe(self._spawn, read_all())

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _add(self, keyed: Keyed) -> None:
        self._waiting += keyed
        self._send()

    def _send(self) -> None:
        """What waits, in requests spread over the free ones (batchSize at most each)."""
        while self._waiting and self._requests < self.client.concurrency and not self._stopped:
            free = self.client.concurrency - self._requests
            size = min(self.client.batch_size, -(-len(self._waiting) // free))
            request, self._waiting = self._waiting[:size], self._waiting[size:]
            self._requests += 1
            self._spawn(self._score(request))

    async def _score(self, keyed: Keyed) -> None:
        started = time.time()
        try:
            samples = [s for _, s in keyed]
            answers = await self.client.score_each(samples, http=self._http, size=len(samples))
        except Exception as error:
            self._fail(error)
            return
        finally:
            self._requests -= 1
            self._send()
        self.on_scored(started, time.time())
        with self._ready:
            self._scores.update(zip((key for key, _ in keyed), service_rewards(answers).tolist(),
                                    strict=True))  # fmt: skip
            self._ready.notify_all()

    def _fail(self, error: BaseException) -> None:
        log.error("scoring the samples as they finish failed: %r", error)
        with self._ready:
            self._failure = error
            self._ready.notify_all()

    def take(self, keys: Sequence[int]) -> torch.Tensor:
        """(B,) the rewards of the samples offered with `keys`, once each is scored (NaN:
        the service failed it)."""
        with self._ready:
            self._ready.wait_for(
                lambda: self._failure is not None or all(k in self._scores for k in keys)
            )
            if self._failure is not None:
                raise RuntimeError("scoring the samples as they finish failed") from self._failure
            return torch.tensor([self._scores.pop(key) for key in keys])
