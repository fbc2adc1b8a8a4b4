"""A job resumed at its last step (its final checkpoint was written, then the attempt
failed) trains nothing, and still reports where it stands: else its status would show
no progress at all for a finished job."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlhf_trainer.loop.run import Run
from tests.specs import local_job
from tests.trainer.local_runs import KeptReports


def test_a_run_resumed_at_its_last_step_reports_it_as_final() -> None:
    config = local_job(colocated=True, total_steps=3, checkpoint_dir=Path("/unused"), every_steps=3)
    reporter = KeptReports()
    trainer: Any = SimpleNamespace(policy_version=3)  # no step runs: nothing else is used
    run = Run(config, trainer, metrics=None, reporter=reporter, step=3)  # type: ignore[arg-type]
    run.last_checkpoint = "/checkpoints/step-00000003"
    final = run.train()
    assert reporter.reports == [(final, True)]
    assert (final.step, final.total_steps, final.last_checkpoint) == (3, 3, run.last_checkpoint)
