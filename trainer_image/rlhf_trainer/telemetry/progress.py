"""What a local run shows on the terminal: a live progress bar while it trains and a
summary table at the end.

On a terminal the bar replaces the progress lines; anywhere else (CI, a pipe) there is
no bar, only plain lines: the loop's per-step log line, and no control characters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from rich.console import Console, RenderableType
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table
from rich.text import Text

from rlhf_trainer.api.progress import EvalProgress, OutputProgress, TrainingProgress
from rlhf_trainer.telemetry.run_folder import StepRecord

STEP_LOG = "rlhf_trainer.steps"  # the loop's line per step, which the bar stands in for


def busy_text(pool_busy: dict[str, float]) -> str:
    """e.g. "busy policy 62% value 18%"."""
    return "busy " + " ".join(f"{pool} {100 * share:.0f}%" for pool, share in pool_busy.items())


def step_text(record: StepRecord) -> str:
    """The bar's numbers, e.g. "reward 0.412 · KL 0.0031 · 85.2 samples/s · busy ..."."""
    return " · ".join(
        [
            f"reward {record.reward_mean:.3f}",
            f"KL {record.kl:.4f}",
            f"{record.samples_per_second:.1f} samples/s",
            busy_text(record.pool_busy),
        ]
    )


class TwoLineProgress(Progress):
    """The bar, then the step's numbers on a line of their own: both fit 80 columns."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            yield Text(task.fields["numbers"], overflow="ellipsis", no_wrap=True)


class LiveProgress:
    """The live bar on a terminal (a no-op elsewhere): step/total, the step's numbers
    and the time left. While it shows, logging goes through its console, above the bar."""

    def __init__(self, console: Console, total_steps: int) -> None:
        self.console = console
        self._bar = TwoLineProgress(
            SpinnerColumn(),
            TextColumn("step"),
            MofNCompleteColumn(table_column=Column(no_wrap=True)),
            BarColumn(bar_width=None),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._bar.add_task("train", total=total_steps, numbers="starting")
        self._first = True
        self._handlers: list[logging.Handler] = []

    @property
    def live(self) -> bool:
        return self.console.is_terminal

    def __enter__(self) -> LiveProgress:
        if self.live:
            root = logging.getLogger()
            self._handlers = root.handlers
            root.handlers = [RichHandler(console=self.console, show_path=False)]
            logging.getLogger(STEP_LOG).setLevel(logging.WARNING)
            self._bar.start()
        return self

    def update(self, record: StepRecord) -> None:
        if self._first:  # a resumed run starts at its checkpoint's step, not 0
            self._bar.reset(self._task, completed=record.step - 1)
            self._first = False
        self._bar.update(self._task, completed=record.step, numbers=step_text(record))

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.live:
            self._bar.stop()
            logging.getLogger().handlers = self._handlers
            logging.getLogger(STEP_LOG).setLevel(logging.NOTSET)


class SilentReporter:
    """Local runs on a terminal: the bar shows the progress, not a line a second."""

    def report(self, progress: TrainingProgress, final: bool = False) -> bool:
        return True


def eval_text(evaluation: EvalProgress) -> str:
    """One held-out evaluation, in a few words."""
    k = evaluation.samples_per_prompt
    passed = f"pass@1 {evaluation.pass_at_1:.2f}"
    if evaluation.pass_at_k is not None:
        passed += f", pass@{k} {evaluation.pass_at_k:.2f}"
    if evaluation.tool_call_rate is not None:
        passed += f", tool calls in {100 * evaluation.tool_call_rate:.0f}% of episodes"
    return f"{evaluation.reward_mean:.3f} at step {evaluation.step} ({passed})"


@dataclass(frozen=True)
class Summary:
    """The end of a local run (or of its interruption)."""

    records: Sequence[StepRecord]  # every step of the run, resumed ones included
    total_steps: int
    wall_seconds: float  # of this process
    run_folder: Path
    last_checkpoint: str | None
    evaluations: Sequence[EvalProgress] = ()  # on the held-out prompts, in order
    output: OutputProgress | None = None  # the trained policy, once written (at the end)

    def table(self) -> Table:
        table = Table(title="Run summary", show_header=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")  # paths whole, on as many lines as they take
        for name, value in self.rows():
            table.add_row(name, value)
        return table

    def rows(self) -> list[tuple[str, str]]:
        records = self.records
        last = records[-1] if records else None
        rows = [
            ("steps", f"{last.step if last else 0}/{self.total_steps}"),
            ("wall time", f"{self.wall_seconds:.0f} s"),
        ]
        if last is not None:
            speed = sum(r.samples_per_second for r in records) / len(records)
            rows += [
                (
                    "reward",
                    f"{records[0].reward_mean:.3f} at step {records[0].step} → "
                    f"{last.reward_mean:.3f} at step {last.step}",
                ),
                ("KL", f"{last.kl:.4f}"),
                ("samples/s", f"{speed:.1f} (mean over steps)"),
            ]
            rows += [(f"pool {p} busy", f"{100 * s:.0f}%") for p, s in last.pool_busy.items()]
            if changes := engine_changes(records):
                rows.append(("rollout engines", changes))
        if self.evaluations:
            first, final = self.evaluations[0], self.evaluations[-1]
            rows.append(("held-out reward", f"{first.reward_mean:.3f} at step {first.step} → "
                         f"{final.reward_mean:.3f} at step {final.step}"))  # fmt: skip
            rows.append(("held-out pass@1", f"{first.pass_at_1:.2f} → {final.pass_at_1:.2f}"))
            if first.pass_at_k is not None and final.pass_at_k is not None:
                k = final.samples_per_prompt
                rows.append(
                    (f"held-out pass@{k}", f"{first.pass_at_k:.2f} → {final.pass_at_k:.2f}")
                )
            if first.tool_call_rate is not None and final.tool_call_rate is not None:
                rates = f"{first.tool_call_rate:.2f} → {final.tool_call_rate:.2f}"
                rows.append(("held-out tool-call rate", rates))
        rows += [
            ("run folder", str(self.run_folder)),
            ("last checkpoint", self.last_checkpoint or "none"),
            ("model", model_row(self.output)),
        ]
        return rows


def model_row(output: OutputProgress | None) -> str:
    if output is None:
        return "not written: the run stopped before its end (rlhfjob export writes a checkpoint's)"
    kind = "LoRA adapter, peft's format" if output.adapter else "Hugging Face"
    return f"{output.path} ({kind}, {output.dtype}, step {output.step})"


def engine_changes(records: Sequence[StepRecord]) -> str:
    """How many rollout engines served, and from which step, when that changed during
    the run (fully async: engines lost or joined); "" when it never did."""
    runs: list[tuple[int, int]] = []  # (engines, first step)
    for record in records:
        if record.rollout_engines and (not runs or runs[-1][0] != record.rollout_engines):
            runs.append((record.rollout_engines, record.step))
    if len(runs) < 2:
        return ""
    return ", ".join(f"{engines} from step {step}" for engines, step in runs)
