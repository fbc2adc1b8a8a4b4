"""The learning bench's chart: held-out reward against samples trained and against
wall-clock, one line per mode (the median over its seeds) in a min-max band."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from rlhf_trainer.telemetry.charts import save_png

# One run's curve: (samples trained, wall-clock seconds, held-out reward) at each evaluation.
Curve = tuple[Sequence[int], Sequence[float], Sequence[float]]


def save_learning_chart(curves: Mapping[str, Sequence[Curve]], path: Path) -> None:
    figure = Figure(figsize=(12.0, 4.5), dpi=100)
    by_samples, by_seconds = figure.subplots(1, 2, sharey=True)
    for mode, runs in curves.items():
        if not runs:
            continue
        points = min(len(run[2]) for run in runs)  # the same evaluations in every run
        rewards = [[run[2][i] for run in runs] for i in range(points)]
        median = [statistics.median(r) for r in rewards]
        low, high = [min(r) for r in rewards], [max(r) for r in rewards]
        samples = list(runs[0][0][:points])
        seconds = [statistics.median(run[1][i] for run in runs) for i in range(points)]
        for axes, x in ((by_samples, samples), (by_seconds, seconds)):
            (line,) = axes.plot(x, median, marker="o", markersize=3, label=mode)
            axes.fill_between(x, low, high, color=line.get_color(), alpha=0.15)
    by_samples.set_xlabel("samples trained")
    by_samples.set_ylabel("held-out reward (median over seeds, min-max band)")
    by_seconds.set_xlabel("wall-clock of the steps (s), median over seeds")
    by_samples.set_title("Held-out reward per sample")
    by_seconds.set_title("Held-out reward per second")
    by_seconds.legend(loc="lower right", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(figure, path)
