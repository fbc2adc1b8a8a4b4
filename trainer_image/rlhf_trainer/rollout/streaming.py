"""The rollouter of fully-async mode: one rank of the rollout pool, generating
continuously and streaming each finished sample into the queue on its own.

The engine (`engine.RolloutEngine`) lives on an asyncio loop of its own thread; the
worker's methods (called one at a time by Ray) hand work to that loop and return, and
its bookkeeping runs on that loop too. Every admitted prompt becomes one request; when it
finishes, its sample moves from `in_flight` to `finished` in the same step of the loop,
and the samples finished in one turn of the loop go to the queue in one `put_many` at
its end (one Ray call for a whole engine step's samples, not one a sample). A snapshot
taken on the loop sends what is finished first, so it sees each sample in exactly one
place: in flight, or delivered. With generation.multiTurn a prompt is an environment
row, and its sample a whole episode: a weight sync pauses it within a turn (the engine
keeps the request) or between turns (its next turn waits for the engine), and its turns
carry the versions that sampled them, so its staleness is its oldest turn's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.rollout.queue import Admitted
from rlhf_trainer.rollout.samples import Sample
from rlhf_trainer.rollout.worker import EngineWorker
from rlhf_trainer.worker import RankInfo, derive_seed

log = logging.getLogger(__name__)


class StreamingRollout(EngineWorker):
    """A vLLM engine that takes prompts, and gives samples to the queue as they finish."""

    def __init__(self, info: RankInfo, config: JobConfig, queue: Any) -> None:
        super().__init__(info, config)
        self.queue = queue  # the SampleQueue actor
        self.in_flight: dict[int, Admitted] = {}
        self.paused = False
        self.busy_since: float | None = None  # generating since (requests in flight)
        self.activity: list[tuple[str, float, float]] = []  # generating spans, for the timeline
        # Marked on the loop, drained from Ray's telemetry thread (never waiting on the loop).
        self.activity_lock = threading.Lock()
        self.finished: list[Sample] = []  # not sent yet: `_deliver` sends them at the turn's end
        self.delivering: list[Any] = []  # queue.put_many futures not yet confirmed

    def admit(self, prompts: Sequence[Admitted]) -> None:
        """Start generating each prompt; returns at once."""
        for admitted in prompts:
            self.engine.spawn(self._generate(admitted))

    async def _generate(self, admitted: Admitted) -> None:
        uid, index, given = admitted
        self.in_flight[uid] = admitted
        self._mark_activity()
        generation = self.config.generation
        seed = derive_seed(self.config.trainer.seed, "sample", uid)
        try:
            if isinstance(given, dict):  # an episode: turns across weight syncs, each labelled
                (rollout,) = await self.episodes_of([given], str(uid), seed)
            else:
                rollout = await self.engine.generate(
                    str(uid),
                    given,
                    max_tokens=self.config.data.max_response_length,
                    temperature=generation.temperature,
                    top_p=generation.top_p,
                    seed=seed,
                )
        except Exception as error:
            # Nobody awaits this request: without word, the trainer would wait for
            # its batch until the queue timeout (an hour).
            log.exception("rollout rank %d: sample %d failed", self.info.rank, uid)
            self.queue.fail.remote(f"rollout rank {self.info.rank}, sample {uid}: {error!r}")
            return
        # No await between these: a snapshot sees the sample in flight or finished.
        versions = tuple(version for version, _ in rollout.version_spans)
        if not self.finished:  # the first of this turn: send them all once it ends
            asyncio.get_running_loop().call_soon(self._deliver)
        self.finished.append(Sample(uid, index, rollout, versions))
        del self.in_flight[uid]
        self._mark_activity()

    def _deliver(self) -> None:
        """Send the finished samples to the queue in one call (on the loop). Requests
        that one engine step finished wake in the same turn of the loop; this runs after
        them all."""
        if self.finished:
            finished, self.finished = self.finished, []
            self.delivering.append(self.queue.put_many.remote(finished))

    def _mark_activity(self) -> None:
        """Open or close the current generating span (on the loop thread). The clock is
        read under the lock, as in `drain_activity`: read before it, a span could end
        before the other thread's start."""
        busy = bool(self.in_flight) and not self.paused
        if busy == (self.busy_since is not None):
            return  # no change (only this thread opens or closes a span): no lock, no clock
        with self.activity_lock:
            now = time.time()
            if busy and self.busy_since is None:
                self.busy_since = now
            elif not busy and self.busy_since is not None:
                self.activity.append((Phase.GENERATE, self.busy_since, now))
                self.busy_since = None

    def drain_activity(self) -> list[tuple[str, float, float]]:
        """The generating spans since the last drain (an open one is cut at now). Any
        thread: it does not wait for the engine's loop, which may be busy loading."""
        with self.activity_lock:
            now = time.time()
            if self.busy_since is not None:
                self.activity.append((Phase.GENERATE, self.busy_since, now))
                self.busy_since = now
            activity, self.activity = self.activity, []
        return activity

    def drain(self) -> None:
        """Wait until every request in flight has finished and reached the queue."""
        self.engine.call(self._drain())

    async def _drain(self) -> None:
        while self.in_flight:
            await asyncio.sleep(0.01)
        await self._snapshot()

    def pause(self) -> None:
        """Freeze the requests in flight where they are (partial rollout)."""
        self.engine.call(self._pause(True))

    def resume(self) -> None:
        self.engine.call(self._pause(False))

    async def _pause(self, pause: bool) -> None:
        await (self.engine.pause() if pause else self.engine.resume())
        self.paused = pause
        self._mark_activity()

    def snapshot(self) -> list[Admitted]:
        """The prompts still in flight, once every finished sample is in the queue."""
        return self.engine.call(self._snapshot())

    async def _snapshot(self) -> list[Admitted]:
        self._deliver()  # a turn's finished samples, not yet sent
        delivering, self.delivering = self.delivering, []
        await asyncio.gather(*delivering)
        return sorted(self.in_flight.values())
