"""What each role did, when, on which pool: the source of the busy metrics and a trace.

The driver wraps each phase it issues in `timeline.span(pool, role, phase)`; a worker
that times its own work hands back (start, end) and the driver calls `record`. Every
span goes to the listeners (the Prometheus metrics) and is kept for the trace, which
`write_chrome_trace` saves in the Chrome trace-event format: open it in Perfetto
(ui.perfetto.dev) or chrome://tracing to see the pools' lanes side by side.

Multi-turn episodes are drawn there too (`add_episodes`): each turn, each environment
call (its tool calls, answered), in lanes of episodes that ran at once on the rollout
pool. They are detail for the trace only: the busy metrics and phase times count the
rollout ranks' generation, which those turns are part of.

Times are wall-clock seconds (`time.time`), not a monotonic clock: spans timed by
workers in other processes, on other nodes, must line up with the driver's.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_trainer.algo.experience import Episode, EpisodePhase


@dataclass(frozen=True)
class Span:
    """One phase run by one role on one pool, from start to end (wall-clock seconds)."""

    pool: str
    role: str
    phase: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


SpanListener = Callable[[Span], None]


class Timeline:
    """A thread-safe record of spans, passed on to listeners as they close.

    Only the newest `keep` spans are kept for the trace, so a long job's memory stays
    bounded; listeners see every span, so the metrics are not affected.
    """

    def __init__(
        self,
        listeners: Sequence[SpanListener] = (),
        clock: Callable[[], float] = time.time,
        keep: int = 100_000,
    ) -> None:
        self._clock = clock
        self._listeners = tuple(listeners)
        self._lock = threading.Lock()
        self._spans: deque[Span] = deque(maxlen=keep)
        self._episode_spans: deque[Span] = deque(maxlen=keep)
        self._episode_lanes = Lanes()
        self.started = clock()  # the origin of the trace's time axis

    @contextmanager
    def span(self, pool: str, role: str, phase: str) -> Iterator[None]:
        """Time the block as `role` running `phase` on `pool` (also when it raises)."""
        start = self._clock()
        try:
            yield
        finally:
            self.record(pool, role, phase, start, self._clock())

    def record(self, pool: str, role: str, phase: str, start: float, end: float) -> Span:
        """Add a span timed elsewhere, e.g. by a worker that returned its (start, end)."""
        if end < start:
            raise ValueError(f"span {phase!r} of {role!r} ends before it starts")
        span = Span(pool, role, phase, start, end)
        with self._lock:
            self._spans.append(span)
        # Outside the lock: a slow listener must not hold up other threads' spans.
        for listener in self._listeners:
            listener(span)
        return span

    def spans(self) -> tuple[Span, ...]:
        with self._lock:
            return tuple(self._spans)

    def add_episodes(self, pool: str, episodes: Sequence[Episode]) -> None:
        """Put each episode's phases on the trace, in the first lane of `pool`'s episodes
        free for its whole length (no listener hears of them)."""
        for episode in episodes:
            if not episode.phases:
                continue
            start, end = episode.phases[0].start, episode.phases[-1].end
            with self._lock:
                role = f"episodes {self._episode_lanes.take(pool, start, end)}"
                self._episode_spans.extend(
                    Span(pool, role, phase_name(phase), phase.start, phase.end)
                    for phase in episode.phases
                )

    def write_chrome_trace(self, path: Path) -> None:
        """Save the spans so far as a trace file, atomically (readers never see half)."""
        with self._lock:
            spans = (*self._spans, *self._episode_spans)
        text = json.dumps(chrome_trace(spans, self.started))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


def chrome_trace(spans: Sequence[Span], origin: float) -> dict[str, Any]:
    """The Chrome trace-event JSON of `spans`: a process per pool, a thread per role.

    The format wants numeric pid/tid, so pools and roles are numbered in order of first
    appearance and named by metadata events; the viewers show the names. Times are
    microseconds since `origin`.
    """
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    events: list[dict[str, Any]] = []
    for span in spans:
        if span.pool not in pids:
            pids[span.pool] = len(pids) + 1
            events.append(_metadata("process_name", pids[span.pool], 0, span.pool))
        pid = pids[span.pool]
        if (span.pool, span.role) not in tids:
            tids[span.pool, span.role] = len(tids) + 1
            events.append(_metadata("thread_name", pid, tids[span.pool, span.role], span.role))
        events.append(
            {
                "name": span.phase,
                "cat": span.role,
                "ph": "X",  # a complete event: start and duration in one
                "pid": pid,
                "tid": tids[span.pool, span.role],
                "ts": _microseconds(span.start - origin),
                "dur": _microseconds(span.seconds),
                "args": {"pool": span.pool, "role": span.role},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


class Lanes:
    """Lanes per pool for intervals that overlap: each goes to the first lane whose
    intervals all end by its start, so no lane holds two at once."""

    def __init__(self) -> None:
        self._ends: dict[str, list[float]] = {}  # pool -> each lane's latest end

    def take(self, pool: str, start: float, end: float) -> int:
        ends = self._ends.setdefault(pool, [])
        lane = next((i for i, last in enumerate(ends) if last <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = max(ends[lane], end)
        return lane + 1


def phase_name(phase: EpisodePhase) -> str:
    """What the trace calls an episode's phase: "turn 2", "tools 2 (3 calls)"."""
    if phase.kind == "step":
        calls = "call" if phase.tool_calls == 1 else "calls"
        return f"tools {phase.turn} ({phase.tool_calls} {calls})"
    return f"turn {phase.turn}" if phase.kind == "turn" else f"environment {phase.kind}"


def _metadata(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 3)
