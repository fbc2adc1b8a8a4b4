"""The bench harness: variants interleaved, comparisons paired within a repeat, and the
timeline shares (pool idle, driver) a bench reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.harness import Measurement, Spread, figures, interleave, run_bench
from bench.timeline import Trace
from rlhf_trainer.telemetry.timeline import Span, chrome_trace


def test_variants_run_interleaved_and_every_figure_is_a_median_and_range() -> None:
    order: list[str] = []

    def variant(name: str, values: list[float]) -> Measurement:
        order.append(name)
        return {"s": values[len([n for n in order if n == name]) - 1]}

    record = run_bench(
        "demo",
        {"a": lambda: variant("a", [3.0, 1.0, 2.0]), "b": lambda: variant("b", [6.0, 2.0, 4.0])},
        3,
        lambda run: {"b_over_a": run["b"]["s"] / run["a"]["s"]},
    )
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert record["figures"]["a.s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    # Paired within each repeat: exactly 2 every time, whatever the machine did.
    assert record["figures"]["b_over_a"] == {"median": 2.0, "min": 2.0, "max": 2.0}


def test_a_comparison_is_paired_not_a_ratio_of_medians() -> None:
    runs = [{"a": {"s": a}, "b": {"s": b}} for a, b in ((1.0, 1.0), (2.0, 4.0), (4.0, 2.0))]
    spreads = figures(runs, lambda run: {"ratio": run["b"]["s"] / run["a"]["s"]})
    assert spreads["ratio"] == Spread(1.0, 0.5, 2.0)
    assert spreads["b.s"].median / spreads["a.s"].median == 1.0  # agrees here by chance only


def test_fewer_than_three_repeats_is_refused() -> None:
    with pytest.raises(ValueError, match="repeats: at least 3"):
        interleave({"a": lambda: {"s": 1.0}}, 2)


def trace_file(tmp: Path, spans: list[tuple[str, float, float]]) -> Path:
    path = tmp / "trace.json"
    events = [Span(pool, "role", "phase", start, end) for pool, start, end in spans]
    path.write_text(json.dumps(chrome_trace(events, origin=0.0)))
    return path


def test_pool_idle_and_driver_shares_from_a_trace(tmp_path: Path) -> None:
    # Two steps of 10 s ending at 20 s: pool p busy 0-5 and 10-14, pool q busy 3-6 and 16-20.
    path = trace_file(tmp_path, [("p", 0, 5), ("q", 3, 6), ("p", 10, 14), ("q", 16, 20)])
    trace = Trace.load(path)
    windows = trace.step_windows([10.0, 10.0])
    assert windows == [(0.0, 10.0), (10.0, 20.0)]
    assert trace.idle_share("p", windows) == pytest.approx(1 - 9 / 20)
    assert trace.idle_share("q", windows) == pytest.approx(1 - 7 / 20)
    # Step 1: some role ran 0-6; step 2: 10-14 and 16-20.
    assert trace.driver_shares(windows) == pytest.approx([0.4, 0.2])
