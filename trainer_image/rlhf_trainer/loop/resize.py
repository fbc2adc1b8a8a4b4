"""A pool of this attempt changes size: stop at a step boundary, after a checkpoint.

The operator cannot add or remove ranks of a pool that trains or scores while a step
runs. When such a pool's `replicas` changes, it marks the job Resizing and lists the
pools in `status.resizing` (operator: controller.resizes). The driver reads that
between steps (`ResizeWatch` is the run's `stop`): once a pool it runs on is to change,
the run checkpoints the step it just finished and stops, and the driver exits 0. The
operator then starts the next attempt on the new sizes, which resumes from that
checkpoint (checkpoints load on any number of ranks), not counted as a restart.

Fully async's own rollout pool never shows here: its engines come and go in place
(loop.membership).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.progress import PoolResize
from rlhf_trainer.telemetry.report import REPORT_EVERY, RateLimit

log = logging.getLogger(__name__)


def resizes_due(config: JobConfig, resizing: Sequence[PoolResize]) -> list[PoolResize]:
    """The resizes that this attempt, started on `config`'s sizes, has not got."""
    sizes = {pool.name: pool.replicas for pool in config.pools}
    return [r for r in resizing if sizes.get(r.pool, r.to_replicas) != r.to_replicas]


class ResizeWatch:
    """The run's `stop` on a cluster: true once the operator resizes one of its pools.
    Reads the job at most every `every` seconds (the API server is shared)."""

    def __init__(
        self,
        config: JobConfig,
        read: Callable[[], list[PoolResize] | None],
        every: float = REPORT_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.read = read
        self.limit = RateLimit(every, clock)
        self.due: list[PoolResize] = []

    def __call__(self) -> bool:
        if not self.due and self.limit.allow():
            self.due = resizes_due(self.config, self.read() or [])
            if self.due:
                log.warning("%s: stopping after this step's checkpoint; the next attempt "
                            "resumes from it on the new sizes", describe(self.due))  # fmt: skip
        return bool(self.due)


def describe(resizes: Sequence[PoolResize]) -> str:
    """e.g. "pool policy changes from 1 to 2 nodes"."""
    return "; ".join(
        f"pool {r.pool} changes from {r.from_replicas} to {r.to_replicas} nodes" for r in resizes
    )
