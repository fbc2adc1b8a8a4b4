"""Per-turn rewards as per-token rewards (algo/turn_rewards.py): each turn's reward times
turnRewardDiscount^turn at its last sampled token, against a naive loop; in
pack_rollouts' layout; and what they change in the advantages."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.estimators import compute_advantages
from rlhf_trainer.algo.experience import Episode, Rollout, TurnReward, pack_rollouts
from rlhf_trainer.algo.turn_rewards import TurnRewardTable, turn_token_rewards
from rlhf_trainer.api.algorithm import AlgorithmConfig
from rlhf_trainer.loop.run import episodes_text
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import PPOTrainer
from tests.unit.test_cut_steps import multi_turn_config


def naive(rollouts: list[Rollout], mask: torch.Tensor, discount: float) -> torch.Tensor:
    start = max(len(r.prompt_token_ids) for r in rollouts)
    out = torch.zeros(mask.shape)
    for b, rollout in enumerate(rollouts):
        for reward in rollout.episode.turn_rewards if rollout.episode else ():
            column = start + reward.token
            if mask[b, column]:
                out[b, column] += reward.reward * discount**reward.turn
    return out


def episode_rollout(rng: random.Random) -> Rollout:
    """Turns of 1-4 sampled tokens, 0-3 observed tokens after each, some rewarded."""
    prompt = [1] * rng.randint(1, 5)
    ids: list[int] = []
    mask: list[int] = []
    rewards: list[TurnReward] = []
    for turn in range(rng.randint(1, 4)):
        ids += [2] * rng.randint(1, 4)
        mask += [1] * (len(ids) - len(mask))
        if rng.random() < 0.7:
            rewards.append(TurnReward(turn, len(ids) - 1, rng.uniform(-1, 1)))
        observed = rng.randint(0, 3)
        ids += [3] * observed
        mask += [0] * observed
    cut = rng.random() < 0.3  # a masked cut: nothing of it counts
    episode = Episode(0.0, turns=turn + 1, tool_calls=0, version_span=0,
                      cut="environment_error" if cut else None, turn_rewards=tuple(rewards))  # fmt: skip
    return Rollout(prompt, ids, [0.0] * len(ids), not cut, 0,
                   loss_mask=tuple(0 if cut else m for m in mask), episode=episode)  # fmt: skip


@pytest.mark.parametrize("discount", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("seed", range(5))
def test_turn_rewards_match_a_naive_loop(seed: int, discount: float) -> None:
    rng = random.Random(seed)
    rollouts = [episode_rollout(rng) for _ in range(6)]
    rollouts.append(Rollout([1, 1], [2, 2], [0.0, 0.0], True, 0))  # no episode
    mask = pack_rollouts(rollouts, pad_id=0).response_mask
    got = turn_token_rewards(TurnRewardTable.of(rollouts), mask, discount)
    expected = naive(rollouts, mask, discount)
    assert torch.allclose(got, expected)
    assert got.abs().sum() > 0 or discount == 0.0  # some reward landed


def test_each_reward_lands_on_a_sampled_token_of_its_turn() -> None:
    rewards = (TurnReward(0, 1, 1.0), TurnReward(1, 4, 2.0))
    episode = Episode(1.0, turns=2, tool_calls=1, version_span=0, turn_rewards=rewards)
    short = Rollout([7], [2, 2, 3, 2, 2], [0.0] * 5, True, 0, loss_mask=(1, 1, 0, 1, 1),
                    episode=episode)  # fmt: skip
    long = Rollout([7, 7, 7], [2], [0.0], True, 0)
    mask = pack_rollouts([short, long], pad_id=0).response_mask  # short's prompt padded by 2
    got = turn_token_rewards(TurnRewardTable.of([short, long]), mask, 0.5)
    assert got[0].tolist() == [0, 0, 0, 0, 1.0, 0, 0, 1.0] and not got[1].any()


def test_turn_rewards_move_the_advantages_of_the_turns_before_them() -> None:
    """Two equal-scored responses in a group: no advantage from the scores (GRPO), but
    the one whose first turn earned a reward gains it on its first turn's tokens."""
    mask = torch.tensor([[1.0, 1, 0, 1, 1], [1, 1, 0, 1, 1]])
    turn_rewards = torch.zeros(2, 5)
    turn_rewards[0, 1] = 1.0
    algorithm = AlgorithmConfig(advantage_estimator="grpo", gamma=1.0)
    args = (torch.ones(2), torch.zeros(2, 5), None, None, mask, algorithm, 2)
    without = compute_advantages(*args).advantages
    with_turns = compute_advantages(*args, turn_rewards=turn_rewards).advantages
    assert not without.any()
    assert with_turns[0].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0] and not with_turns[1].any()


def test_the_step_log_gives_the_turn_rewards_per_episode() -> None:
    rewarded = Episode(1.0, turns=2, tool_calls=1, version_span=0,
                       turn_rewards=(TurnReward(0, 3, 0.5), TurnReward(1, 9, 0.25)))  # fmt: skip
    plain = Episode(0.0, turns=1, tool_calls=0, version_span=0)
    assert EpisodeStats((rewarded, plain)).turn_reward_mean == 0.375
    assert episodes_text(EpisodeStats((rewarded, plain))).endswith(", turn rewards 0.375")
    assert EpisodeStats((plain,)).turn_reward_mean is None
    assert "turn rewards" not in episodes_text(EpisodeStats((plain,)))


def test_a_batch_without_turn_rewards_gets_none() -> None:
    plain = Rollout([1], [2, 3], [0.0, 0.0], True, 0, episode=Episode(1.0, 1, 0, 0))
    table = TurnRewardTable.of([plain, plain])
    assert table.columns.shape == (2, 0)
    mask = pack_rollouts([plain, plain], pad_id=0).response_mask
    assert not turn_token_rewards(table, mask, 0.9).any()


def test_the_step_takes_the_specs_discount() -> None:
    """PPOTrainer.turn_rewards: what train_on hands compute_advantages."""
    config = multi_turn_config(turnRewardDiscount=0.5)
    parts = cast(RunParts, SimpleNamespace(
        config=config, plan=None, groups=None, prompts=None, timeline=None, scorer=None,
        weights=None, engines=None,
    ))  # fmt: skip
    episode = Episode(1.0, 2, 1, 0, turn_rewards=(TurnReward(0, 0, 1.0), TurnReward(1, 2, 1.0)))
    rollout = Rollout([1], [2, 3, 2], [0.0] * 3, True, 0, loss_mask=(1, 0, 1), episode=episode)
    mask = pack_rollouts([rollout], pad_id=0).response_mask
    got = PPOTrainer(parts).turn_rewards([rollout], mask)
    assert got is not None and got.tolist() == [[0.0, 1.0, 0.0, 0.5]]
