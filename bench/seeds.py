"""Benches that train a job once per seed, their variants interleaved within each seed
(bench/harness.py), and read from each run's steps what it learned: bench/agentic and
bench/agent_gateway.

- Seeds: each variant's runs take the seeds in turn, so that within a repeat every
  variant trains on the same seed.
- learned: a run's figures of learning, the same in every such bench: the held-out score
  before training and after it, and the tool calls a training episode made.
- show_run: a line per run on stderr, as the run ends.
"""

from __future__ import annotations

import sys

from bench.harness import Measurement
from rlhf_trainer.loop.sync import StepResult


class Seeds:
    """Each variant's next seed, from `first` on: the harness runs every variant once a
    repeat, so repeat i trains every variant on seed first + i."""

    def __init__(self, first: int = 0) -> None:
        self.first = first
        self._taken: dict[str, int] = {}  # variant -> runs so far

    def take(self, variant: str) -> int:
        seed = self.first + self._taken.get(variant, 0)
        self._taken[variant] = self._taken.get(variant, 0) + 1
        return seed


def learned(steps: list[StepResult], tool_calls: bool) -> Measurement:
    """A run's learning, from its steps:
        held_out_start    the held-out score before training (step 0)
        held_out_final    the held-out score after the last step
        pass_final        the share of held-out episodes that pass, after the last step
    and where the trainer parsed the episodes' tool calls (`tool_calls`: multi-turn
    episodes, not an agent's, whose calls are its own):
        tool_calls_first  tool calls per training episode at the first step
        tool_calls_last   the same at the last step
    """
    evaluations = sorted((e for s in steps for e in s.evaluations), key=lambda e: e.step)
    assert evaluations and evaluations[0].step == 0, "no held-out evaluation before training"
    figures = {
        "held_out_start": evaluations[0].reward_mean,
        "held_out_final": evaluations[-1].reward_mean,
        "pass_final": evaluations[-1].pass_at_1,
    }
    if tool_calls:
        first, last = steps[0].episodes, steps[-1].episodes
        assert first is not None and last is not None, "no multi-turn episodes reported"
        figures |= {
            "tool_calls_first": first.tool_calls_mean,
            "tool_calls_last": last.tool_calls_mean,
        }
    return figures


def show_run(variant: str, seed: int, steps: int, measured: Measurement) -> None:
    """The run's line on stderr: its variant, seed, steps and figures."""
    shown = ", ".join(f"{key} {value:.3f}" for key, value in measured.items())
    print(f"run: {variant} seed {seed}, {steps} steps: {shown}", file=sys.stderr, flush=True)
