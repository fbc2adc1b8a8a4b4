"""The streaming rollout sends the samples that finish in one turn of its engine's loop
to the queue in one `put_many`, and a snapshot still sees each sample in exactly one
place: in flight on the engine, or in the queue (the checkpoint contract of
rollout/queue.py). A stand-in engine (an event loop, requests released by hand) and a
stand-in queue actor (a real SampleQueue, each call delivered late on a thread)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import Role
from rlhf_trainer.rollout import streaming, worker
from rlhf_trainer.rollout.queue import QueueClosed, SampleQueue
from rlhf_trainer.rollout.samples import Sample
from rlhf_trainer.worker import RankInfo
from tests.specs import local_async_job

pytestmark = pytest.mark.unit

T = TypeVar("T")
TRANSIT_S = 0.05  # how late the stand-in queue takes each call


class Engine:
    """Stands in for RolloutEngine: its loop on a thread; a request finishes when its
    gate (`gates[uid]`, an asyncio.Event) is set."""

    def __init__(self, model_dir: str, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.gates: dict[str, asyncio.Event] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def spawn(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.spawn(coroutine).result(timeout=30)

    async def generate(self, request_id: str, prompt: list[int], **_: Any) -> Rollout:
        await self.gates.setdefault(request_id, asyncio.Event()).wait()
        return Rollout(prompt, [7], [-0.5], True, 0, ((0, 0),))

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class Method:
    def __init__(self, queue: Queue, name: str) -> None:
        self.queue, self.name = queue, name

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        """Like a Ray call: sent now, taken a little later, awaited on the caller's loop."""
        self.queue.calls.append(self.name)

        def late() -> Any:
            time.sleep(TRANSIT_S)
            return getattr(self.queue.inner, self.name)(*args)

        return asyncio.wrap_future(self.queue.pool.submit(late))


class Queue:
    """Stands in for the SampleQueue actor; `calls` records the methods called."""

    def __init__(self) -> None:
        self.inner = SampleQueue()
        self.pool = ThreadPoolExecutor(4)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)


@pytest.fixture
def rollout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(worker, "model_path", lambda source, seed: str(tmp_path))
    monkeypatch.setattr(worker, "RolloutEngine", Engine)
    config = local_async_job(staleness=1, total_steps=1, checkpoint_dir=tmp_path, every_steps=1)
    info = RankInfo(Role.ROLLOUT, "rollout", rank=0, world_size=1)
    rank = streaming.StreamingRollout(info, config, queue=Queue())
    yield rank
    rank.engine.shutdown()


def release(rollout: Any, uids: range) -> None:
    """Finish requests `uids` at once: they wake in the same turn of the loop."""

    async def open_gates() -> None:
        for uid in uids:
            rollout.engine.gates.setdefault(str(uid), asyncio.Event()).set()

    rollout.engine.call(open_gates())


def test_a_turns_samples_go_in_one_call_and_a_snapshot_sees_each_once(rollout: Any) -> None:
    rollout.admit([(uid, uid, [1, 2]) for uid in range(8)])
    while len(rollout.in_flight) < 8:  # admitted on the loop
        time.sleep(0.01)
    release(rollout, range(5))
    in_flight = rollout.snapshot()  # waits for the put in transit
    queued = rollout.queue.inner.snapshot()
    assert [uid for uid, _, _ in in_flight] == [5, 6, 7]
    assert [s.uid for s in queued] == [0, 1, 2, 3, 4]
    assert rollout.queue.calls == ["put_many"]  # five samples, one call

    release(rollout, range(5, 8))
    rollout.drain()
    assert [s.uid for s in rollout.queue.inner.snapshot()] == list(range(8))
    assert rollout.queue.calls == ["put_many", "put_many"]


def test_a_snapshot_in_the_turn_that_finished_samples_sends_them_first(rollout: Any) -> None:
    """Samples finished, their `put_many` not yet sent when the snapshot runs: the
    snapshot sends it and waits for it, so they are neither lost nor in flight."""
    rollout.admit([(uid, uid, [1, 2]) for uid in range(4)])
    while len(rollout.in_flight) < 4:
        time.sleep(0.01)

    async def finish_two_then_snapshot() -> list[Any]:
        for uid in ("0", "1"):
            rollout.engine.gates.setdefault(uid, asyncio.Event()).set()
        await asyncio.sleep(0)  # the two finish in the next turn, before this resumes
        assert len(rollout.finished) == 2, "finished, not sent yet"
        in_flight: list[Any] = await rollout._snapshot()
        return in_flight

    in_flight = rollout.engine.call(finish_two_then_snapshot())
    assert [uid for uid, _, _ in in_flight] == [2, 3]
    assert [s.uid for s in rollout.queue.inner.snapshot()] == [0, 1]
    time.sleep(2 * TRANSIT_S)  # the turn's own `_deliver` has run since: nothing to send
    assert rollout.queue.calls == ["put_many"]
    release(rollout, range(2, 4))
    rollout.drain()
    assert [s.uid for s in rollout.queue.inner.snapshot()] == [0, 1, 2, 3]


def sample(uid: int) -> Sample:
    return Sample(uid, uid, Rollout([1], [2], [-0.1], True, 0))


def test_put_many_queues_each_uid_once_and_whole_groups_only() -> None:
    queue = SampleQueue(group_size=2)
    assert queue.put_many([sample(0), sample(1), sample(2), sample(1)]) == 3
    assert queue.put_many([sample(2), sample(3), sample(0)]) == 4  # 2 and 0 came before
    batch = queue.get_batch(4, timeout_s=1)
    assert batch is not None and [s.uid for s in batch] == [0, 1, 2, 3]
    queue.close()
    with pytest.raises(QueueClosed):
        queue.put_many([sample(4)])
    assert queue.snapshot() == []


def test_generating_spans_open_with_the_first_request_and_close_with_the_last(
    rollout: Any,
) -> None:
    rollout.admit([(uid, uid, [1, 2]) for uid in range(3)])
    while len(rollout.in_flight) < 3:
        time.sleep(0.01)
    (cut,) = rollout.drain_activity()  # the open span, cut at now and open from there
    release(rollout, range(2))
    assert rollout.drain_activity()[0][1] == cut[2]  # still one span: one still in flight
    release(rollout, range(2, 3))
    rollout.drain()
    (last,) = rollout.drain_activity()
    assert cut[1] <= cut[2] <= last[1] <= last[2]
    assert rollout.busy_since is None and rollout.drain_activity() == []
