"""A batch's data rows as the samples the update trains on (pure: no I/O).

A data row gives one sample, except an agent episode, which gives the sample holding
its last call and the episode's other samples (`Rollout.others`: calls that extended
nothing, at most generation.agent.maxSamplesPerEpisode in all). A row is scored once,
and each of its samples takes the row's reward times its share (callDiscount**k, as
AReaL does), and the row's group for the group baselines:

    rows (R,) ─ scored ─▶ (R,) ─ [row] · share ─▶ samples (S,), grouped by their row's group

Without agent episodes S = R, every share is 1 and each sample is its row: nothing
changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_trainer.algo.experience import Rollout


@dataclass(frozen=True)
class RowSamples:
    """The samples of a batch's rows, a row's together: its others, then its own."""

    rollouts: list[Rollout]  # (S,)
    rows: Tensor  # (S,) long: the row each came from
    shares: Tensor  # (S,) float64: its share of its row's reward (1 for a row's own)
    own: Tensor  # (R,) long: where each row's own sample is among the S

    @classmethod
    def of(cls, rows: Sequence[Rollout]) -> RowSamples:
        rollouts: list[Rollout] = []
        row_of: list[int] = []
        shares: list[float] = []
        own: list[int] = []
        for row, rollout in enumerate(rows):
            for other in rollout.others:
                rollouts.append(other.rollout)
                row_of.append(row)
                shares.append(other.share)
            own.append(len(rollouts))
            rollouts.append(rollout)
            row_of.append(row)
            shares.append(1.0)
        return cls(
            rollouts,
            torch.tensor(row_of, dtype=torch.long),
            torch.tensor(shares, dtype=torch.float64),
            torch.tensor(own, dtype=torch.long),
        )

    def __len__(self) -> int:
        return len(self.rollouts)

    def scores(self, row_scores: Tensor) -> Tensor:
        """(R,) the rows' rewards -> (S,) each sample's: its row's times its share (NaN,
        a row left unscored, stays NaN)."""
        return row_scores[self.rows] * self.shares.to(row_scores.dtype)

    def groups(self, group_size: int) -> Tensor:
        """(S,) long: each sample's group, its row's (rows g·n … g·n + n - 1 are group g)."""
        return self.rows // group_size
