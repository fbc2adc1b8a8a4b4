"""The work queue: no duplicate waiting keys, no concurrent processing of one key."""

from __future__ import annotations

import asyncio

from rlhf_operator.controller.drift import replica_ops
from rlhf_operator.controller.workqueue import WorkQueue


def test_a_key_waits_once_however_often_it_is_added() -> None:
    async def scenario() -> list[tuple[str, str]]:
        queue = WorkQueue()
        for _ in range(3):
            queue.add(("ns", "a"))
        queue.add(("ns", "b"))
        assert len(queue) == 2
        return [await queue.get(), await queue.get()]

    assert asyncio.run(scenario()) == [("ns", "a"), ("ns", "b")]


def test_a_key_added_while_active_is_processed_again_after() -> None:
    async def scenario() -> None:
        queue = WorkQueue()
        queue.add(("ns", "a"))
        key = await queue.get()
        queue.add(key)  # a change arrives while we reconcile
        assert len(queue) == 0  # not handed to a second worker meanwhile
        queue.done(key)
        assert len(queue) == 1 and await queue.get() == key
        queue.done(key)
        assert len(queue) == 0

    asyncio.run(scenario())


def test_add_later_requeues_after_the_delay() -> None:
    async def scenario() -> None:
        queue = WorkQueue()
        queue.add_later(("ns", "a"), 0.01)
        assert len(queue) == 0
        assert await asyncio.wait_for(queue.get(), timeout=5) == ("ns", "a")

    asyncio.run(scenario())


def test_add_later_replaces_the_pending_delay_of_the_key() -> None:
    async def scenario() -> None:
        queue = WorkQueue()
        queue.add_later(("ns", "a"), 0.01)
        queue.add_later(("ns", "a"), 3600)  # e.g. a second failure: a longer backoff
        await asyncio.sleep(0.05)  # past the first delay: it no longer holds
        assert len(queue) == 0
        queue.add_later(("ns", "a"), 0.01)  # and a shorter one replaces a longer one
        assert await asyncio.wait_for(queue.get(), timeout=5) == ("ns", "a")

    asyncio.run(scenario())


def test_replica_ops_set_each_changed_group_by_name() -> None:
    live = [{"groupName": "a", "replicas": 1, "minReplicas": 1, "maxReplicas": 1},
            {"groupName": "b", "replicas": 2, "minReplicas": 2}]  # fmt: skip
    wanted = [{"groupName": "b", "replicas": 3}, {"groupName": "a", "replicas": 1}]
    assert replica_ops(live, wanted, at="/spec") == [
        {"op": "add", "path": "/spec/workerGroupSpecs/1/replicas", "value": 3},
        {"op": "add", "path": "/spec/workerGroupSpecs/1/minReplicas", "value": 3},
        {"op": "add", "path": "/spec/workerGroupSpecs/1/maxReplicas", "value": 3},
    ]
    assert replica_ops(live[:1], wanted, at="/spec") == []
