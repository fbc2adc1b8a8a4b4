"""Fully async PPO: prompt admission and the message queue between rollout and trainer.

The rollouter (the rollout role on its own pool) admits prompts through an
`AdmissionControl`, generates, and `put`s each finished `Sample` into a `SampleQueue`
as soon as it is done (`put_many`: those one engine step finished, in one call); the
trainer takes mini-batches with `get_batch` as they fill. Both classes are plain Python
and thread-safe where they need to be; Ray is only at the edge: `spawn_queue` runs a
`SampleQueue` as a threaded actor.

Checkpoint contract (a resumed run loses no sample and trains none twice):

- Take the checkpoint between trainer steps: after the step that consumed the last
  batch has been applied, and before the next `get_batch` is issued. Then every sample
  is in exactly one of three places: already trained on (its effect is in the
  weights), waiting in the queue (`SampleQueue.snapshot` captures exactly these), or
  in flight in the rollouter (admitted, not yet `put`). A trainer that prefetches the
  next batch (a `get_batch` issued before the checkpoint) must save that batch itself,
  ahead of the snapshot, or it is lost.
- In-flight samples are the rollouter's business: at the checkpoint it saves them (a
  partial rollout) or the prompts to generate again; uids are handed out in admission
  order (`AdmissionControl.admitted_total`), so the in-flight ones are the admitted
  uids neither trained on nor in the snapshot.
- On resume, `SampleQueue.restore` the snapshot into the new, still empty queue
  before the rollouter puts anything, and `AdmissionControl.restore` the admission
  state saved with it (admissions since the last sync still count against the limit).
- Checkpoints hold them as JSON (`Sample.to_json`), like the rest of the driver's
  state, not pickled.

Groups (samplesPerPrompt n > 1, for the critic-free estimators): admission counts
prompts, and prompt number g of the run becomes the samples with uids g·n … g·n + n - 1,
so a sample's group is `uid // n`. The queue holds a group back until all n of its
samples have arrived and hands out whole groups only; snapshots and restores keep the
partial ones, so a resumed run still trains each group once, whole.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

from rlhf_trainer.rollout.samples import Sample

DEFAULT_QUEUE_CONCURRENCY = 16
# The last uids put are remembered, so that a sample generated twice is queued once
# (remembered_uids); at least this many, however small the job.
MIN_REMEMBERED_UIDS = 1 << 16
# A lost engine's prompt, answered again elsewhere, can have had its first answer put
# before the loss: within the sync intervals the admission limit lets run ahead. Four
# intervals' worth of samples covers that with room to spare.
REMEMBERED_INTERVALS = 4

# A prompt given to an engine: (uid, prompt index, its token ids; with
# generation.multiTurn, the environment row its episode starts from).
Admitted = tuple[int, int, list[int] | dict[str, Any]]


class AdmissionControl:
    """Stops the rollouter from running too far ahead of the trainer.

    With `batch_size` B samples per trainer step, a weight sync every `sync_every` K
    steps and staleness threshold s, at most `limit` = floor(B·K·(1+s)) prompts are
    admitted between two weight syncs. s is taken as the decimal it is written as
    (s = 0.1 is 1/10 exactly, not the binary float just above it), so the product is
    exact before rounding down; since s ≥ 0, `limit` ≥ B·K, and s = 0 gives exactly
    B·K: synchronous, on-policy. Not thread-safe: the rollouter's admission loop owns it.
    """

    def __init__(self, batch_size: int, sync_every: int, staleness: float) -> None:
        self.batch_size = batch_size
        self.sync_every = sync_every
        self.staleness = staleness
        self.limit = admission_limit(batch_size, sync_every, staleness)
        self.admitted_since_sync = 0
        self.admitted_total = 0  # over the whole run: the next prompt's (group's) number

    def try_admit(self) -> bool:
        """Admit one prompt if under the limit (and count it); False means wait for a sync."""
        if self.admitted_since_sync >= self.limit:
            return False
        self.admitted_since_sync += 1
        self.admitted_total += 1
        return True

    def on_weight_sync(self, outstanding: int = 0) -> None:
        """New weights reached the rollouter: a fresh allowance of `limit` prompts, less
        the `outstanding` ones admitted before and not trained yet (queued or still in
        flight). They are stale now and count against the new allowance, or the backlog
        (and the staleness) would grow by B·K·s at every sync."""
        if outstanding < 0:
            raise ValueError(f"outstanding must be >= 0, got {outstanding}")
        self.admitted_since_sync = outstanding

    def on_dropped(self, groups: int) -> None:
        """`groups` admitted prompts left without being trained (dynamic sampling
        dropped them): like trained ones they are no longer outstanding, so as many new
        prompts may take their place."""
        if not 0 <= groups <= self.admitted_since_sync:
            raise ValueError(
                f"{groups} dropped, but {self.admitted_since_sync} admitted since the sync"
            )
        self.admitted_since_sync -= groups

    def state(self) -> dict[str, int]:
        """JSON-able state for a checkpoint."""
        return {
            "admitted_since_sync": self.admitted_since_sync,
            "admitted_total": self.admitted_total,
        }

    def restore(self, state: Mapping[str, int]) -> None:
        """Continue from `state()`. The limit is this object's (the config may change on
        resume); admissions since the sync above a smaller limit just wait for a sync."""
        since, total = int(state["admitted_since_sync"]), int(state["admitted_total"])
        if not 0 <= since <= total:
            raise ValueError(
                f"inconsistent admission state: {since} admitted since the sync, {total} in all"
            )
        self.admitted_since_sync, self.admitted_total = since, total


class QueueClosed(RuntimeError):
    """A sample was put into a closed queue."""


class RolloutFailed(RuntimeError):
    """The rollouter reported that it cannot deliver samples any more."""


def admission_limit(batch_size: int, sync_every: int, staleness: float) -> int:
    """floor(B·K·(1+s)), exactly (see AdmissionControl)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if sync_every < 1:
        raise ValueError(f"sync_every must be at least 1, got {sync_every}")
    if not math.isfinite(staleness) or staleness < 0:
        raise ValueError(f"staleness must be a finite number >= 0, got {staleness}")
    return math.floor(Fraction(batch_size * sync_every) * (1 + Fraction(repr(float(staleness)))))


def remembered_uids(limit: int, group_size: int) -> int:
    """How many of the last uids a queue remembers, for an admission `limit` between
    syncs and groups of `group_size`: REMEMBERED_INTERVALS intervals of samples."""
    return max(MIN_REMEMBERED_UIDS, REMEMBERED_INTERVALS * limit * group_size)


class SampleQueue:
    """A thread-safe FIFO of finished samples, consumed in whole batches of whole groups.

    `get_batch` hands out exactly `size` samples, whole groups in the order they were
    completed, or None (timeout or closed queue), never fewer: a batch is taken in one
    step under the lock, so two getters never interleave and a sample is delivered at
    most once. Unbounded: `AdmissionControl` bounds what the rollouter can put. `depth`
    (every sample held, partial groups too) feeds `rlhf_queue_depth`.
    """

    def __init__(
        self,
        group_size: int = 1,
        remembered: int = MIN_REMEMBERED_UIDS,
        keep_arrivals: bool = False,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.group_size = group_size
        self.remembered = remembered  # uids: see remembered_uids
        # With keep_arrivals, every sample put or restored, in order, until `arrivals`
        # has handed it out (to its one reader: the driver's scorer).
        self._arrivals: deque[Sample] | None = deque() if keep_arrivals else None
        self._arrived = 0  # samples put or restored over the queue's life
        self._samples: deque[Sample] = deque()  # whole groups, a group's samples together
        self._partial: dict[int, list[Sample]] = {}  # group -> the samples that arrived
        self._ready = threading.Condition()
        self._closed = False
        self._failure: str | None = None  # why the rollouter stopped, if it did
        self._waiting = 0  # getters blocked in get_batch
        self._received: deque[int] = deque()  # the last `remembered` uids put, in order
        self._received_set: set[int] = set()

    def _remember(self, uid: int) -> bool:
        """Note `uid` as received; False if it already was (under the lock)."""
        if uid in self._received_set:
            return False
        self._received.append(uid)
        self._received_set.add(uid)
        if len(self._received) > self.remembered:
            self._received_set.discard(self._received.popleft())
        return True

    def put(self, sample: Sample) -> int:
        """Append a sample; returns the depth after it. A uid that came before is
        dropped: a prompt of a lost engine, generated again elsewhere, whose first
        answer was delivered after all. Raises QueueClosed once closed."""
        with self._ready:
            if self._closed:
                raise QueueClosed(f"sample {sample.uid} put into a closed queue")
            if not self._remember(sample.uid):
                return self._depth()
            self._add(sample)
            self._ready.notify_all()  # getters wait for different sizes: let each check
            return self._depth()

    def put_many(self, samples: Iterable[Sample]) -> int:
        """`put` each sample, in order, in one step under the lock (one call for all the
        samples an engine step finished); returns the depth after them. A uid that came
        before, or twice in `samples`, is queued once. Raises QueueClosed once closed,
        queuing none of them."""
        with self._ready:
            if self._closed:
                raise QueueClosed("samples put into a closed queue")
            for sample in samples:
                if self._remember(sample.uid):
                    self._add(sample)
            self._ready.notify_all()
            return self._depth()

    def _add(self, sample: Sample) -> None:
        """Queue the sample, or hold it until its group is whole (under the lock)."""
        self._arrived += 1
        if self._arrivals is not None:
            self._arrivals.append(sample)
        number = sample.uid // self.group_size
        group = self._partial.setdefault(number, [])
        group.append(sample)
        if len(group) == self.group_size:
            self._samples.extend(sorted(group, key=lambda s: s.uid))
            del self._partial[number]

    def _depth(self) -> int:
        return len(self._samples) + sum(map(len, self._partial.values()))

    def get_batch(self, size: int, timeout_s: float | None = None) -> list[Sample] | None:
        """Block until `size` samples are queued and take them, oldest first.

        None if `timeout_s` passes first (None waits without limit) or the queue is or
        gets closed; the samples then stay queued (see `snapshot`). Raises
        RolloutFailed once the rollouter has reported a failure (`fail`).
        """
        if size < 1 or size % self.group_size:
            raise ValueError(
                f"a batch is whole groups of {self.group_size} samples, got size {size}"
            )
        with self._ready:
            self._waiting += 1
            try:
                ready = self._ready.wait_for(
                    lambda: self._closed or self._failure is not None or len(self._samples) >= size,
                    timeout=timeout_s,
                )
            finally:
                self._waiting -= 1
            if self._failure is not None:
                raise RolloutFailed(self._failure)
            if not ready or self._closed:
                return None
            return [self._samples.popleft() for _ in range(size)]

    def arrivals(self, after: int, timeout_s: float) -> tuple[list[Sample], int]:
        """The samples put or restored after the first `after`, in order, and how many
        have arrived in all (the next call's `after`); waits up to `timeout_s` for one
        (not after `close`). For one reader: those up to `after` are forgotten."""
        log = self._arrivals
        if log is None:
            raise ValueError("this queue keeps no arrivals (keep_arrivals=False)")
        with self._ready:
            if after < self._arrived - len(log):
                raise ValueError(f"arrivals after {after}: those are handed out already")
            for _ in range(min(len(log), after - (self._arrived - len(log)))):
                log.popleft()  # the reader has them
            self._ready.wait_for(lambda: self._closed or self._arrived > after, timeout_s)
            first = self._arrived - len(log)  # arrivals before log[0]
            return list(log)[after - first :], self._arrived

    def depth(self) -> int:
        with self._ready:
            return self._depth()

    def not_received(self, uids: Iterable[int]) -> list[int]:
        """Those of `uids` that no sample has been put for: what a lost engine still
        owed (what it did deliver may be queued, or trained already)."""
        with self._ready:
            return [uid for uid in uids if uid not in self._received_set]

    def waiting_getters(self) -> int:
        """How many `get_batch` calls are blocked waiting for samples now."""
        with self._ready:
            return self._waiting

    def fail(self, reason: str) -> None:
        """The rollouter cannot deliver samples any more (its engine died): every
        waiting and later `get_batch` raises RolloutFailed(reason) rather than wait."""
        with self._ready:
            self._failure = reason
            self._ready.notify_all()

    def close(self) -> None:
        """Wake every waiting getter with None, and refuse further puts and batches."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    @property
    def closed(self) -> bool:
        with self._ready:
            return self._closed

    def snapshot(self) -> list[Sample]:
        """The queued samples, whole groups first and then the partial ones, without
        taking them (see the module's checkpoint contract). Works after `close` too."""
        with self._ready:
            partial = sorted((s for g in self._partial.values() for s in g), key=lambda s: s.uid)
            return list(self._samples) + partial

    def restore(self, samples: Iterable[Sample]) -> None:
        """Put back a snapshot into a fresh queue, before any new sample arrives.

        Raises if the queue already holds samples (the snapshot's are older and must come
        out first) or the samples repeat a uid (a replayed sample would train twice).
        """
        restored = list(samples)
        uids = [s.uid for s in restored]
        if len(set(uids)) != len(uids):
            raise ValueError(f"the samples to restore repeat uids: {sorted(uids)}")
        with self._ready:
            if self._closed:
                raise QueueClosed("cannot restore samples into a closed queue")
            if self._depth():
                raise ValueError(f"restore into a queue that already holds {self._depth()} samples")
            for sample in restored:
                self._remember(sample.uid)
                self._add(sample)
            self._ready.notify_all()

    def snapshot_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.snapshot()]

    def restore_json(self, data: Iterable[Mapping[str, Any]]) -> None:
        self.restore(Sample.from_json(d) for d in data)
