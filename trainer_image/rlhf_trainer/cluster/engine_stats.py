"""The rollout engines' vLLM stats, polled for the driver's /metrics.

A rollout rank's actor answers `engine_stats` on a thread of its own (the TELEMETRY
concurrency group, `groups`), so it answers while its working thread is inside a
call, such as generating a synchronous batch or waiting on a fully-async drain; the
answer reads metric values in the rank's process and never waits on the engine. A
daemon thread on the driver asks every engine every few seconds and hands the answers
to `TrainerMetrics.engines`, which a scrape reads: neither a step nor a scrape waits
on an engine.

An engine that has not answered yet is not asked again meanwhile, and its series keep
their last values; one whose actor is dead loses its series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.telemetry.engine_stats import EngineStats

if TYPE_CHECKING:
    from rlhf_trainer.cluster.groups import ObjectRef

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 5.0
FINAL_POLL_TIMEOUT_S = 10.0

# (pool, engine rank, its stats or None when it is gone): EngineSeries.observe
Observe = Callable[[str, int, EngineStats | None], None]


class EngineStatsPoller:
    """Asks the rollout group's engines for their stats every `interval_s`, on a daemon
    thread, from `start` to `stop`. `group`: the group, or what returns it as it is now
    (engines lost or joined)."""

    def __init__(
        self,
        group: WorkerGroup | Callable[[], WorkerGroup],
        observe: Observe,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.group = group if callable(group) else lambda: group
        self.observe = observe
        self.interval_s = interval_s
        self._asked: dict[int, ObjectRef[EngineStats | None]] = {}  # rank -> its answer
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-stats", daemon=True)

    def start(self) -> EngineStatsPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling after one last poll, so the series end with the engines' final
        counts. Call it before the group shuts down."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._poll_or_log(FINAL_POLL_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._poll_or_log(self.interval_s)
            self._stopping.wait(self.interval_s)

    def _poll_or_log(self, timeout_s: float) -> None:
        """A poll whose failure only costs the metrics, not the polling or the run."""
        try:
            self.poll(timeout_s)
        except Exception:
            log.exception("polling the rollout engines' stats failed")

    def poll(self, timeout_s: float) -> None:
        """Ask every engine with no question pending, and report the answers that come
        within `timeout_s`."""
        import ray

        group = self.group()
        for position, rank in enumerate(group.ranks):
            if rank not in self._asked:
                self._asked[rank] = group.engine_stats(position)
        for gone in set(self._asked) - set(group.ranks):  # an engine lost: no series
            del self._asked[gone]
            self.observe(group.pool, gone, None)
        ready, _ = ray.wait(
            list(self._asked.values()), num_returns=len(self._asked), timeout=timeout_s
        )
        answered = set(ready)
        for rank, ref in list(self._asked.items()):
            if ref not in answered:
                continue
            del self._asked[rank]
            try:
                stats = ray.get(ref)
            except ray.exceptions.RayError:  # the actor died: the engine is gone
                stats = None
            self.observe(group.pool, rank, stats)
