"""bench/seeds.py, what bench/agentic and bench/agent_gateway share: the seeds each
variant's runs take, and a run's figures of learning read from its steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.seeds import Seeds, learned
from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.experience import Episode
from rlhf_trainer.loop.sync import StepResult
from tests.unit.test_local_run import evaluation, step_result


def episodes(*tool_calls: int) -> EpisodeStats:
    return EpisodeStats(tuple(Episode(0.0, 1, n, 0) for n in tool_calls))


def run() -> list[StepResult]:
    """Three steps, held out before training (0.1) and after the last (0.5); the first
    step's episodes call the tool once in four, the last step's every time."""
    return [
        replace(step_result(1), evaluations=(evaluation(0, 0.1),), episodes=episodes(0, 0, 0, 1)),
        step_result(2),
        replace(step_result(3), evaluations=(evaluation(3, 0.5),), episodes=episodes(1, 1)),
    ]


def test_every_variant_takes_the_seeds_in_turn_so_a_repeat_is_one_seed() -> None:
    seeds = Seeds(first=2)
    taken = [seeds.take(variant) for _ in range(3) for variant in ("a", "b")]
    assert taken == [2, 2, 3, 3, 4, 4]


def test_a_run_learned_from_its_held_out_score_and_its_tool_calls_first_and_last() -> None:
    assert learned(run(), tool_calls=True) == {
        "held_out_start": 0.1,
        "held_out_final": 0.5,
        "pass_final": 0.25,  # evaluation(): pass@1 is half the reward
        "tool_calls_first": 0.25,
        "tool_calls_last": 1.0,
    }
    # An agent's calls are its own: no tool calls of the trainer's to report.
    assert set(learned(run(), tool_calls=False)) == {
        "held_out_start",
        "held_out_final",
        "pass_final",
    }


def test_a_run_without_a_held_out_score_before_training_is_no_measurement() -> None:
    steps = run()
    steps[0] = replace(steps[0], evaluations=())
    with pytest.raises(AssertionError, match="before training"):
        learned(steps, tool_calls=False)
