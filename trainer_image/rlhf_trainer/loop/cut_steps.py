"""How many training steps in a row cut too many of their episodes: a run whose every
episode is cut (an environment that always fails, a budget nothing fits in) learns
nothing and would go on for ever. generation.multiTurn.maxCutRatio and maxCutSteps say
when it fails instead, naming the cuts."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.api.agentic import MultiTurnConfig


class TooManyCuts(RuntimeError):
    """The run cut too many episodes, too many steps in a row (the job's status names it)."""


@dataclass
class CutSteps:
    """Steps in a row whose share of cut episodes reached multiTurn.maxCutRatio; the
    run fails once there are multiTurn.maxCutSteps of them."""

    max_ratio: float
    max_steps: int
    in_a_row: int = 0

    @classmethod
    def of(cls, multi_turn: MultiTurnConfig) -> CutSteps:
        return cls(multi_turn.max_cut_ratio, multi_turn.max_cut_steps)

    def count(self, step: int, episodes: EpisodeStats) -> None:
        """The step's episodes, before it trains on them; raises TooManyCuts on the last
        step in a row the limit allows."""
        ratio = episodes.cut_ratio
        self.in_a_row = self.in_a_row + 1 if ratio >= self.max_ratio else 0
        if self.in_a_row >= self.max_steps:
            cuts = ", ".join(f"{reason} {n}" for reason, n in sorted(episodes.cuts.items()))
            raise TooManyCuts(
                f"step {step}: {self.in_a_row} steps in a row cut at least "
                f"{self.max_ratio:.0%} of their episodes (multiTurn.maxCutRatio "
                f"{self.max_ratio:g}, maxCutSteps {self.max_steps}); this step cut "
                f"{sum(episodes.cuts.values())} of {len(episodes.episodes)}: {cuts}"
            )
