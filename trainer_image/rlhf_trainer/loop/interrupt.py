"""Ctrl-C in a local run: finish the step under way, checkpoint it, and stop.

The handler only sets a flag; the loop checks it between steps (Run.train's `stop`), so
a checkpoint is always taken at a step boundary. A second Ctrl-C quits at once, without
that checkpoint, as Python's default does.

Ray's own processes (the local cluster's raylet, GCS and workers) share the terminal's
process group, but Ray starts them with SIGINT blocked (ray._private.services), so the
workers are still there to save their shards when the driver asks.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)


class StopRequest:
    """Set by the first SIGINT; the loop reads it between steps."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("stopping after this step to save a checkpoint (Ctrl-C again to quit now)")


@contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    """Within the block, SIGINT asks the run to stop at the next step boundary."""
    request = StopRequest()
    previous = signal.signal(signal.SIGINT, request._on_sigint)
    try:
        yield request
    finally:
        signal.signal(signal.SIGINT, previous)
