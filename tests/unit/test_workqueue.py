"""The work queue: no duplicate waiting keys, no concurrent processing of one key, new
jobs' keys first."""

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


def drain(queue: WorkQueue) -> list[tuple[str, str]]:
    """Every waiting key, in the order workers would take them (each done at once)."""

    async def take() -> list[tuple[str, str]]:
        taken = []
        while len(queue):
            key = await queue.get()
            queue.done(key)
            taken.append(key)
        return taken

    return asyncio.run(take())


def test_urgent_keys_are_taken_before_normal_ones_added_earlier() -> None:
    queue = WorkQueue()
    queue.add(("ns", "report-a"))
    queue.add(("ns", "new-b"), urgent=True)
    queue.add(("ns", "report-c"))
    queue.add(("ns", "new-d"), urgent=True)
    assert [name for _, name in drain(queue)] == ["new-b", "new-d", "report-a", "report-c"]


def test_a_waiting_key_added_urgently_moves_up_and_is_taken_once() -> None:
    queue = WorkQueue()
    queue.add(("ns", "a"))
    queue.add(("ns", "b"))
    queue.add(("ns", "b"), urgent=True)
    queue.add(("ns", "b"))  # not moved back down
    assert len(queue) == 2
    assert drain(queue) == [("ns", "b"), ("ns", "a")]


def test_past_max_defer_the_normal_and_urgent_keys_take_turns() -> None:
    now = [0.0]

    async def scenario() -> list[str]:
        queue = WorkQueue(max_defer=60, clock=lambda: now[0])
        queue.add(("ns", "report-1"))
        queue.add(("ns", "report-2"))
        now[0] = 30.0
        for i in range(1, 5):
            queue.add(("ns", f"new-{i}"), urgent=True)
        now[0] = 59.0
        taken = [await queue.get()]  # the reports have waited 59 s: they still wait
        now[0] = 61.0  # past max_defer: turn about until no report is overdue
        while len(queue):
            taken.append(await queue.get())
        return [name for _, name in taken]

    assert asyncio.run(scenario()) == [
        "new-1", "new-2", "report-1", "new-3", "report-2", "new-4"
    ]  # fmt: skip


def test_a_key_added_urgently_while_active_comes_back_urgent() -> None:
    async def scenario() -> list[tuple[str, str]]:
        queue = WorkQueue()
        queue.add(("ns", "a"), urgent=True)
        key = await queue.get()
        queue.add(("ns", "b"))
        queue.add(key)
        queue.add(key, urgent=True)  # e.g. the user edited the new job meanwhile
        queue.done(key)
        return [await queue.get(), await queue.get()]

    assert asyncio.run(scenario()) == [("ns", "a"), ("ns", "b")]


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
