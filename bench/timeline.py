"""What a run's Chrome trace says about its measured steps: each pool's idle share and
the driver's own share (time in no role's span), step by step."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_trainer.telemetry.metrics import Interval, union_seconds


@dataclass(frozen=True)
class Trace:
    spans: dict[str, list[Interval]]  # pool -> its roles' spans, in seconds
    end: float  # when the last span ended

    @classmethod
    def load(cls, path: Path) -> Trace:
        events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
        pools = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        spans: dict[str, list[Interval]] = {}
        for e in events:
            if e["ph"] == "X":
                start = e["ts"] / 1e6
                spans.setdefault(pools[e["pid"]], []).append((start, start + e["dur"] / 1e6))
        return cls(spans, max(end for pool in spans.values() for _, end in pool))

    def step_windows(self, step_seconds: Sequence[float]) -> list[Interval]:
        """The last steps' wall-clock windows: they ran back to back up to the trace's end."""
        windows, end = [], self.end
        for seconds in reversed(step_seconds):
            windows.append((end - seconds, end))
            end -= seconds
        return windows[::-1]

    def busy(self, window: Interval, pools: Sequence[str] | None = None) -> float:
        """Seconds of the window in which any role of the pools (all: None) ran."""
        start, end = window
        clipped = [
            (max(start, a), min(end, b))
            for pool in (pools if pools is not None else list(self.spans))
            for a, b in self.spans.get(pool, [])
        ]
        return union_seconds([(a, b) for a, b in clipped if b > a])

    def idle_share(self, pool: str, windows: Sequence[Interval]) -> float:
        wall = sum(end - start for start, end in windows)
        return 1 - sum(self.busy(w, [pool]) for w in windows) / wall

    def driver_shares(self, windows: Sequence[Interval]) -> list[float]:
        """Per step: the share of its wall time in which no role of any pool ran."""
        return [1 - self.busy(w) / (w[1] - w[0]) for w in windows]
