"""A batch's data rows as the samples the update trains on (pure: no I/O).

A data row gives one sample, except an agent episode, which gives the sample holding
its last call and the episode's other samples (`Rollout.others`: calls that extended
nothing, at most generation.agent.maxSamplesPerEpisode in all). A row is scored once,
and each of its samples takes the row's reward times its share (callDiscount**k, as
AReaL does), and the row's group for the group baselines:

    rows (R,) ─ scored ─▶ (R,) ─ [row] · share ─▶ samples (S,), grouped by their row's group

Without agent episodes S = R, every share is 1 and each sample is its row: nothing
changes. With them S varies from step to step, and the batch is padded with masked
one-token rows to a multiple of trainer.miniBatchSize, as R always is: every rank of a
role then gets as many rows, and so runs as many mini- and micro-batches (FSDP's
collectives need every rank in each of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_trainer.algo.experience import Rollout, masked_placeholder


@dataclass(frozen=True)
class RowSamples:
    """The samples of a batch's rows, a row's together: its others, then its own; then
    `padding` masked rows (`batch`)."""

    rollouts: list[Rollout]  # (S,)
    rows: Tensor  # (S,) long: the row each came from
    shares: Tensor  # (S,) float64: its share of its row's reward (1 for a row's own)
    own: Tensor  # (R,) long: where each row's own sample is among the S
    padding: int = 0  # masked rows after the S, in a group of their own

    @classmethod
    def of(cls, rows: Sequence[Rollout], multiple: int = 1) -> RowSamples:
        """The rows' samples, padded to a multiple of `multiple` rows when there are more
        than rows (rows of one sample each are left as they are)."""
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
            padding_rows(len(rollouts), multiple) if len(rollouts) > len(rows) else 0,
        )

    def __len__(self) -> int:  # the samples, without the padding
        return len(self.rollouts)

    @property
    def batch(self) -> list[Rollout]:
        """(S + padding,) what the step packs: the samples, then the padding rows."""
        version = self.rollouts[0].policy_version if self.rollouts else 0
        return [*self.rollouts, *[masked_placeholder(version)] * self.padding]

    def scores(self, row_scores: Tensor) -> Tensor:
        """(R,) the rows' rewards -> (S + padding,) each sample's: its row's times its
        share (NaN, a row left unscored, stays NaN); 0 for the padding."""
        scores = row_scores[self.rows] * self.shares.to(row_scores.dtype)
        return torch.cat([scores, scores.new_zeros(self.padding)])

    def groups(self, group_size: int) -> Tensor:
        """(S + padding,) long: each sample's group, its row's (rows g·n … g·n + n - 1
        are group g); the padding's, one after the last (all equal: no advantage)."""
        groups = self.rows // group_size
        after = int(groups.max()) + 1 if len(groups) else 0
        return torch.cat([groups, torch.full((self.padding,), after, dtype=torch.long)])


def padding_rows(samples: int, multiple: int) -> int:
    """Rows to add to `samples` for a multiple of `multiple`: never one alone, since the
    padding is a group of its own and RLOO's baseline needs two a group."""
    padding = -samples % multiple
    return padding + multiple if padding == 1 else padding
