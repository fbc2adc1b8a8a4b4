"""The sample queue of fully-async mode as a Ray actor on the driver's node."""

from __future__ import annotations

from typing import Any

from rlhf_trainer.rollout.queue import (
    DEFAULT_QUEUE_CONCURRENCY,
    MIN_REMEMBERED_UIDS,
    SampleQueue,
)


def spawn_queue(
    group_size: int = 1,
    remembered: int = MIN_REMEMBERED_UIDS,
    keep_arrivals: bool = False,
    *,
    max_concurrency: int = DEFAULT_QUEUE_CONCURRENCY,
    name: str | None = None,
) -> Any:
    """Start a `SampleQueue(group_size, remembered, keep_arrivals)` as a Ray actor on this (the
    driver's) node; returns its handle.

    A threaded actor: each call runs on one of `max_concurrency` threads, so a
    `get_batch` blocked waiting for samples holds one thread while puts, `depth`,
    `snapshot` and `close` run on the others. It must exceed the number of getters that
    may block at once. It asks for no CPU (it only moves references and waits) and is
    pinned to the current node with a hard NodeAffinitySchedulingStrategy, so it lives
    and dies with the driver on the head node, not on a pool's GPU node (in a local
    run, the head is the first pool's first node, which is never killed).

    Ordering: a threaded actor does not run one caller's calls in submission order, so a
    producer that needs its samples queued in order waits for each `put`'s result
    before sending the next. The handle's methods are SampleQueue's, called as
    `handle.put.remote(sample)`, `ray.get(handle.get_batch.remote(size, timeout_s))`.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if max_concurrency < 2:
        raise ValueError(
            f"max_concurrency must be at least 2 (a blocked getter and a put), got "
            f"{max_concurrency}"
        )
    remote_queue: Any = ray.remote(SampleQueue)
    here = ray.get_runtime_context().get_node_id()
    return remote_queue.options(
        num_cpus=0,
        max_concurrency=max_concurrency,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        name=name,
    ).remote(group_size, remembered, keep_arrivals)


def close_queue(handle: Any) -> None:
    """End the queue actor: close it (a getter blocked in it returns), then kill it, so
    that it does not outlive the run on the driver's node."""
    import ray

    try:
        ray.get(handle.close.remote(), timeout=10)
    finally:
        ray.kill(handle)
