"""The run folder's PNG charts, drawn from its step records.

Figures are made with matplotlib's object API, not pyplot: no global figure state and no
display needed (a terminal, CI or a container); saving a PNG renders with Agg.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from rlhf_trainer.api.progress import EvalProgress
from rlhf_trainer.telemetry.run_folder import RunFolder, StepRecord

SIZE_INCHES = (8.0, 4.5)
DPI = 100  # 800 x 450 pixels


def reward_kl_figure(
    records: Sequence[StepRecord], evaluations: Sequence[EvalProgress] = ()
) -> Figure:
    """Mean reward on the training prompts and on the held-out ones (left axis) and KL
    to the reference (right axis) over the steps."""
    figure = Figure(figsize=SIZE_INCHES, dpi=DPI)
    reward_axes = figure.add_subplot()
    steps = [r.step for r in records]
    reward_axes.plot(steps, [r.reward_mean for r in records], color="tab:blue", label="reward")
    if evaluations:
        reward_axes.plot(
            [e.step for e in evaluations],
            [e.reward_mean for e in evaluations],
            color="tab:green",
            marker="o",
            label="held-out reward",
        )
    reward_axes.set_xlabel("step")
    reward_axes.set_ylabel("mean reward")
    kl_axes = reward_axes.twinx()  # KL is orders of magnitude below the reward
    kl_axes.plot(steps, [r.kl for r in records], color="tab:red", label="KL")
    kl_axes.set_ylabel("KL to the reference")
    # one legend for both axes, inside them (a figure legend would cover the title)
    kl_axes.legend(handles=[*reward_axes.get_lines(), *kl_axes.get_lines()], loc="best")
    reward_axes.set_title("Reward and KL")
    return figure


def pool_busy_figure(records: Sequence[StepRecord]) -> Figure:
    """Each pool's busy share (since the trainer started) over the steps, in percent."""
    figure = Figure(figsize=SIZE_INCHES, dpi=DPI)
    axes = figure.add_subplot()
    pools = sorted({pool for r in records for pool in r.pool_busy})
    for pool in pools:
        kept = [r for r in records if pool in r.pool_busy]
        axes.plot([r.step for r in kept], [100 * r.pool_busy[pool] for r in kept], label=pool)
    axes.set_ylim(0, 100)
    axes.set_xlabel("step")
    axes.set_ylabel("busy since start (%)")
    axes.set_title("Pool busy share")
    if pools:
        axes.legend(loc="best")
    return figure


def save_png(figure: Figure, path: Path) -> None:
    """Write through a temporary file: an interrupted write leaves the last chart."""
    partial = path.with_suffix(".png.partial")
    figure.savefig(partial, format="png")
    partial.replace(path)


def write_charts(folder: RunFolder) -> None:
    records = folder.records()
    save_png(reward_kl_figure(records, folder.evaluations()), folder.reward_chart)
    save_png(pool_busy_figure(records), folder.busy_chart)
