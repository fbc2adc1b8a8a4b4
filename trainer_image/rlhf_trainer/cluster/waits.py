"""Waiting for what the ranks' calls return (their Ray futures), without hanging on a
rank that is gone: `join` (and `gather`, which re-joins batch shards), the streams of
calls that yield results as they come (`results_as_they_come`), and looks that never
wait (`finished`, `answered`) or wait a while (`unfinished_after`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from rlhf_trainer.cluster.hangs import (
    RankCall,
    forget,
    no_answer,
    out_of_memory,
    peer_died,
    rank_died,
    record,
)
from rlhf_trainer.worker import BatchT, concat_batches

if TYPE_CHECKING:
    from ray import ObjectRef

T = TypeVar("T")


def join(
    refs: Sequence[ObjectRef[T]],
    timeout_s: float | None = None,
    involved: Sequence[ObjectRef[Any]] = (),
) -> list[T]:
    """Wait for the futures and return their results, in order.

    Raises as soon as any of them fails: when one rank dies, the others may wait in a
    collective for it until the rendezvous timeout, and waiting for them in order
    would hang the driver just as long. A call that fails while others are pending is
    reported as a rank's death if one of theirs dies within PEER_DEATH_S. With
    `timeout_s`, raises NoAnswer once that has passed, naming the ranks still in their
    calls (`cluster.hangs`), among them those of `involved`: calls in the same
    collective that are not waited for here.
    """
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            raise no_answer([*pending, *involved], float(timeout_s or 0))
        try:
            ray.get(done)  # raises the failure, if that is what finished
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as error:
            raise rank_died(done[0], error) from error
        except ray.exceptions.RayTaskError as error:
            if out_of_memory(error) is not None:
                raise rank_died(done[0], error) from error
            if (died := peer_died([*pending, *involved])) is not None:
                raise died from error  # the cause, not the collective's echo of it
            raise
    forget(refs)
    return list(ray.get(list(refs)))


@dataclass(frozen=True)
class Streams:
    """One streaming call per rank (`WorkerGroup.stream_each`)."""

    calls: list[RankCall]  # who each is, to name a rank that dies
    generators: list[Any]  # Ray's ObjectRefGenerator of each


def results_as_they_come(streams: Streams) -> Iterator[tuple[int, Any]]:
    """(i, result) for each result the ranks' streams yield, as it comes, i being the
    stream's place in `streams`. A rank whose process dies raises RankDied, naming it;
    a rank's error is raised as `join` raises it."""
    import ray

    place = {id(generator): i for i, generator in enumerate(streams.generators)}
    waiting: list[Any] = list(streams.generators)
    while waiting:
        ready: list[Any]
        ready, waiting = ray.wait(waiting, num_returns=1)
        for generator in ready:  # an ObjectRefGenerator: its next result is ready
            i = place[id(generator)]
            try:
                ref = next(generator)
            except StopIteration:
                continue
            record(ref, streams.calls[i])
            (result,) = join([ref])
            waiting.append(generator)
            yield i, result


def finished(refs: Sequence[ObjectRef[Any]]) -> bool:
    """Whether every one of the futures has its result (or its error); never waits."""
    import ray

    return not ray.wait(list(refs), num_returns=len(refs), timeout=0)[1]


def unfinished_after(refs: Sequence[ObjectRef[Any]], timeout_s: float) -> list[int]:
    """The places in `refs` of the futures still without a result (or an error) once
    `timeout_s` has passed; waits no longer than all of them take."""
    import ray

    if not refs:
        return []
    pending = {ref.binary() for ref in ray.wait(list(refs), num_returns=len(refs),
                                                timeout=timeout_s)[1]}  # fmt: skip
    return [i for i, ref in enumerate(refs) if ref.binary() in pending]


def answered(refs: Sequence[ObjectRef[Any]]) -> bool:
    """Whether every one of the futures has its result, not an error; never waits."""
    if not finished(refs):
        return False
    try:
        join(refs)
    except Exception:
        return False
    return True


def gather(refs: Sequence[ObjectRef[BatchT]]) -> BatchT:
    """Wait for the ranks' batch results and re-join them in rank order."""
    return concat_batches(join(refs))
