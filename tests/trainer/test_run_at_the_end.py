"""A job resumed at its last step (its final checkpoint was written, then the attempt
failed) trains nothing, and still reports where it stands: else its status would show
no progress at all for a finished job."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlhf_trainer.loop.run import Run
from rlhf_trainer.loop.weights import SyncFailure
from tests.specs import local_job
from tests.trainer.local_runs import KeptReports


def test_a_run_resumed_at_its_last_step_reports_it_as_final() -> None:
    config = local_job(colocated=True, total_steps=3, checkpoint_dir=Path("/unused"), every_steps=3)
    reporter = KeptReports()
    engines = SimpleNamespace(last_failed_sync=None)
    trainer: Any = SimpleNamespace(policy_version=3, engines=engines)  # no step runs
    run = Run(config, trainer, metrics=None, reporter=reporter, step=3)  # type: ignore[arg-type]
    run.last_checkpoint = "/checkpoints/step-00000003"
    final = run.train()
    assert reporter.reports == [(final, True)]
    assert (final.step, final.total_steps, final.last_checkpoint) == (3, 3, run.last_checkpoint)


def test_the_last_failed_weight_sync_is_reported_in_the_progress() -> None:
    """An engine replaced after a stalled sync: the run went on, and its status says
    which sync failed, where, and how far it got (loop.membership keeps the last)."""
    config = local_job(colocated=True, total_steps=3, checkpoint_dir=Path("/unused"), every_steps=3)
    line = (
        "rollout rank(s) 1 on pool policy missed the bucket deadline of a weight sync "
        "with 4096 of 65536 bytes moved"
    )
    engines = SimpleNamespace(last_failed_sync=SyncFailure("bucket", line))
    trainer: Any = SimpleNamespace(policy_version=3, engines=engines)
    run = Run(config, trainer, metrics=None, reporter=KeptReports(), step=3)  # type: ignore[arg-type]
    assert run.train().last_failed_sync == line
    wire = run.progress(None).model_dump(by_alias=True, exclude_none=True)
    assert wire["lastFailedSync"] == line
