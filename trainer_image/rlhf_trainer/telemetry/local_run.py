"""Watching a local run: each step goes to the run folder's metrics.jsonl (each held-out
evaluation to eval.jsonl) and to the live bar; the charts are redrawn every few steps
(so an interrupted run has them) and at the end."""

from __future__ import annotations

from rlhf_trainer.telemetry.charts import write_charts
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.progress import LiveProgress
from rlhf_trainer.telemetry.run_folder import RunFolder, StepOutcome, StepRecord


class LocalRunWatch:
    """The loop's `on_step` for a local run."""

    def __init__(
        self,
        folder: RunFolder,
        metrics: TrainerMetrics,
        progress: LiveProgress,
        samples_per_step: int,
        chart_every: int,
    ) -> None:
        self.folder = folder
        self.metrics = metrics
        self.progress = progress
        self.samples_per_step = samples_per_step
        self.chart_every = chart_every
        self._first = True

    def __call__(self, result: StepOutcome) -> None:
        if self._first:  # the steps after the checkpoint resumed from are trained again
            self.folder.forget_after(result.step - 1)
            self._first = False
        busy = self.metrics.pool_busy_ratios()
        record = StepRecord.of(result, self.samples_per_step, busy)
        self.folder.append(record)
        for evaluation in result.evaluations:
            self.folder.append_eval(evaluation)
        self.progress.update(record)
        if result.step % self.chart_every == 0:
            write_charts(self.folder)

    def finish(self) -> list[StepRecord]:
        """Draw the charts of every step so far; the records, for the summary."""
        write_charts(self.folder)
        return self.folder.records()
