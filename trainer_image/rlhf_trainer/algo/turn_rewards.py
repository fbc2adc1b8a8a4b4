"""Per-turn rewards: what an environment gave each turn of an episode (Step.reward), as
per-token rewards on top of the final score.

    turn k's reward r_k ─▶ γ_turn^k · r_k at the turn's last sampled token ─▶ (B, T)

γ_turn is generation.multiTurn.turnRewardDiscount (1: every turn's reward in full). The
final score stays on the response's last counted token (ppo.token_rewards); GAE or the
returns-to-go then carry every reward back over the tokens before it, as they do the
score's. Positions the mask does not count (a masked episode, an unscored sample) get
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_trainer.algo.experience import Rollout


@dataclass(frozen=True)
class TurnRewardTable:
    """A batch's per-turn rewards, padded to the most any row has (K)."""

    columns: Tensor  # (B, K) long: the column of the turn's last sampled token; 0 as padding
    rewards: Tensor  # (B, K) the environment's reward for the turn; 0 as padding
    turns: Tensor  # (B, K) the turn, from 0

    @classmethod
    def of(cls, rollouts: Sequence[Rollout]) -> TurnRewardTable:
        """The rollouts' rewards in pack_rollouts' layout: responses start at the column
        after the longest prompt."""
        start = max(len(r.prompt_token_ids) for r in rollouts)
        rows = [r.episode.turn_rewards if r.episode is not None else () for r in rollouts]
        size = (len(rows), max((len(row) for row in rows), default=0))
        columns = torch.zeros(size, dtype=torch.long)
        rewards, turns = torch.zeros(size), torch.zeros(size)
        for b, row in enumerate(rows):
            for k, reward in enumerate(row):
                columns[b, k] = start + reward.token
                rewards[b, k], turns[b, k] = reward.reward, reward.turn
        return cls(columns, rewards, turns)


def turn_token_rewards(table: TurnRewardTable, mask: Tensor, discount: float) -> Tensor:
    """(B, T) each turn's reward times discount^turn at its column, 0 where mask is 0.

    mask: (B, T) the response tokens that count. Two rewards at one column add up.
    """
    weighted = table.rewards * discount**table.turns  # (B, K)
    rewards = torch.zeros(mask.shape, dtype=weighted.dtype).scatter_add(1, table.columns, weighted)
    return rewards * mask
