"""generation.multiTurn.maxCutRatio and maxCutSteps (issue 72): a run that cuts too many
of its episodes, too many steps in a row, fails naming the cuts (TooManyCuts), before it
trains on the step; the job's status says so as it says every failure (failure_line)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.experience import Episode, Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.loop.cut_steps import CutSteps, TooManyCuts
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import Batch, PPOTrainer
from rlhf_trainer.telemetry.report import failure_line

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"


def stats(*cuts: str | None) -> EpisodeStats:
    return EpisodeStats(tuple(Episode(0.0, 1, 0, 0, cut=cut) for cut in cuts))


ALL_CUT = stats("environment_unreachable: refused", "environment_unreachable: refused")
HALF_CUT = stats("max_turns", None)


def test_the_run_fails_on_the_last_step_in_a_row_the_limit_allows() -> None:
    steps = CutSteps(max_ratio=1.0, max_steps=3)
    steps.count(1, ALL_CUT)
    steps.count(2, ALL_CUT)
    steps.count(3, HALF_CUT)  # under the ratio: the count starts again
    steps.count(4, ALL_CUT)
    steps.count(5, ALL_CUT)
    with pytest.raises(TooManyCuts) as failed:
        steps.count(6, ALL_CUT)
    line = failure_line(failed.value)
    assert line.startswith("TooManyCuts: step 6: 3 steps in a row cut at least 100%"), line
    assert "maxCutRatio 1, maxCutSteps 3" in line
    assert "this step cut 2 of 2: environment_unreachable 2" in line


def test_a_lower_ratio_counts_steps_that_reach_it() -> None:
    steps = CutSteps(max_ratio=0.5, max_steps=2)
    steps.count(1, HALF_CUT)
    with pytest.raises(TooManyCuts, match="max_turns 1"):
        steps.count(2, HALF_CUT)
    never = CutSteps(max_ratio=0.6, max_steps=1)
    for step in range(1, 10):
        never.count(step, HALF_CUT)


def multi_turn_config(**multi_turn: Any) -> JobConfig:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["environments"] = [{"name": "lookup", "url": "http://127.0.0.1:9"}]
    manifest["spec"]["generation"]["multiTurn"].update(multi_turn)
    return parse_job(manifest).spec.job_config()


def test_the_step_raises_before_it_trains_on_anything() -> None:
    """The synchronous step (and fully async's, which trains through it) counts its
    episodes first: with maxCutSteps 1 an all-cut batch fails the step before any role
    is called (the trainer's parts here have no roles to call)."""
    config = multi_turn_config(maxCutSteps=1, maxCutRatio=0.5)
    assert config.multi_turn is not None and config.multi_turn.max_cut_ratio == 0.5
    parts = cast(RunParts, SimpleNamespace(
        config=config, plan=None, groups=None, prompts=None, timeline=None, scorer=None,
        weights=None, engines=None,
    ))  # fmt: skip
    cut = Episode(0.0, 1, 0, 0, cut="environment_error: HTTP 500")
    rollouts = [Rollout([1], [2], [0.0], False, 0, episode=cut)] * 2
    with pytest.raises(TooManyCuts, match="environment_error 2"):
        PPOTrainer(parts).train_on(7, Batch([], rollouts, [0, 1]))


def test_by_default_only_steps_whose_every_episode_was_cut_count() -> None:
    config = multi_turn_config()
    assert config.multi_turn is not None
    steps = CutSteps.of(config.multi_turn)
    assert (steps.max_ratio, steps.max_steps) == (1.0, 3)
    for step in range(1, 10):
        steps.count(step, HALF_CUT)
