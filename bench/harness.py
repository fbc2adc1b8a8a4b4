"""One way to compare variants on a shared, noisy machine (2 cores here, ±15% run to run).

- The variants run interleaved, A B A B A B, so a slow minute of the machine falls on
  both rather than on whichever ran then.
- Comparisons (a speedup, an efficiency) are taken within each repeat, A_i against B_i,
  then summarised: the ratio of two medians would pair a fast A with a slow B.
- Every figure is reported as the median and the min-max of its repeats, in a table and
  in one JSON line (the last line a bench prints; `python -m bench` collects them).

    def colocated() -> Measurement: ...   # one run: {"step_s": 0.41, ...}
    def split() -> Measurement: ...
    def compare(run: dict[str, Measurement]) -> Measurement:
        return {"speedup": run["colocated"]["step_s"] / run["split"]["step_s"]}
    record = run_bench("split", {"colocated": colocated, "split": split}, 3, compare)
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Measurement = dict[str, float]  # figure -> value, from one run of one variant
Variant = Callable[[], Measurement]
Compare = Callable[[dict[str, Measurement]], Measurement]  # variant -> its run, one repeat

MIN_REPEATS = 3


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def to_json(self) -> dict[str, float]:
        return {"median": _round(self.median), "min": _round(self.low), "max": _round(self.high)}

    def __str__(self) -> str:
        return f"{self.median:.4g} ({self.low:.4g}-{self.high:.4g})"


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def interleave(variants: Mapping[str, Variant], repeats: int) -> list[dict[str, Measurement]]:
    """Each repeat runs every variant once, in the same order: A B, A B, A B."""
    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats: at least {MIN_REPEATS} for a median and a range, got {repeats}")
    runs = []
    for repeat in range(repeats):
        run = {}
        for name, variant in variants.items():
            print(f"[repeat {repeat + 1}/{repeats}] {name}", file=sys.stderr, flush=True)
            run[name] = variant()
        runs.append(run)
    return runs


def figures(runs: Sequence[dict[str, Measurement]], compare: Compare | None) -> dict[str, Spread]:
    """Every variant's figures ("variant.figure") and the comparisons, over the repeats."""
    columns: dict[str, list[float]] = {}
    for run in runs:
        flat = {f"{name}.{k}": v for name, measured in run.items() for k, v in measured.items()}
        for key, value in {**flat, **(compare(run) if compare else {})}.items():
            columns.setdefault(key, []).append(value)
    return {key: Spread.of(values) for key, values in columns.items()}


def run_bench(
    bench: str,
    variants: Mapping[str, Variant],
    repeats: int,
    compare: Compare | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Interleave, summarise, print the table and the JSON line; returns the record."""
    spreads = figures(interleave(variants, repeats), compare)
    width = max(len(key) for key in spreads)
    print(f"{'figure':<{width}}  median (min-max) over {repeats} interleaved repeats")
    for key, spread in spreads.items():
        print(f"{key:<{width}}  {spread}")
    record = {
        "bench": bench,
        "repeats": repeats,
        **settings,
        "figures": {key: spread.to_json() for key, spread in spreads.items()},
    }
    print(json.dumps(record), flush=True)
    return record
