"""Advantage estimators: from one score per response to per-token advantages.

    scores (B,) ─ outcome baseline ─▶ (B,) ─ token_rewards (+ KL, + turns' rewards) ─▶ (B, T)
          ─ GAE with the critic's values (gae) | returns-to-go (critic-free) ─▶ advantages
          ─ normalised: over the batch (gae if configured, reinforce++ always) ─▶

The critic-free estimators replace the critic's value baseline with one made from the
other responses to the same prompt (a group of n = samplesPerPrompt). A batch keeps a
group's rows together: rows g·n … g·n + n - 1 answer prompt g.

- grpo: (r - mean_g) / std_g (Shao et al. 2024); without the division, Dr. GRPO.
- rloo: r - mean of the other n - 1 responses (Ahmadian et al. 2024).
- reinforce++: raw scores, returns normalised over the whole batch (Hu 2025).
- reinforce++-baseline: r - mean_g, then normalised over the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_trainer.algo.ppo import gae, kl_penalty, token_rewards, whiten
from rlhf_trainer.api.algorithm import AdvantageEstimator, AlgorithmConfig

GROUP_STD_EPS = 1e-6  # keeps the division finite; all-equal groups are zeroed apart


def grouped(scores: Tensor, group_size: int) -> Tensor:
    """(B,) -> (G, n): one row per prompt. B must be a multiple of n."""
    if group_size < 1 or len(scores) % group_size:
        raise ValueError(f"{len(scores)} scores do not make groups of {group_size}")
    return scores.view(-1, group_size)


def group_normalized(scores: Tensor, group_size: int, divide_by_std: bool = True) -> Tensor:
    """GRPO's outcome advantage, (B,): each score less its group's mean, divided by the
    group's standard deviation (Bessel-corrected, as in GRPO) unless `divide_by_std` is
    False (Dr. GRPO, which found the division biases towards easy and hard prompts)."""
    groups = grouped(scores, group_size)  # (G, n)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if divide_by_std:
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        centred = centred / (std + GROUP_STD_EPS)
    return zero_where_all_equal(centred, groups).reshape(-1)


def zero_where_all_equal(advantages: Tensor, groups: Tensor) -> Tensor:
    """(G, n) advantages, exactly 0 in groups whose scores are all equal. Their float mean
    can be off by one ulp (0.7 or 1/3 in float32), and dividing that by std + eps would
    give the whole group a uniform advantage of up to ~0.1 instead of none."""
    return advantages.masked_fill(~_informative(groups).unsqueeze(1), 0.0)


def _informative(groups: Tensor) -> Tensor:
    """(G, n) -> (G,) bool: the groups whose scores are not all equal."""
    return groups.amax(dim=1) > groups.amin(dim=1)


def leave_one_out(scores: Tensor, group_size: int) -> Tensor:
    """RLOO's outcome advantage, (B,): each score less the mean of the other n - 1
    scores of its group. Needs n >= 2."""
    if group_size < 2:
        raise ValueError(f"a leave-one-out baseline needs groups of 2 or more, got {group_size}")
    groups = grouped(scores, group_size)  # (G, n)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return zero_where_all_equal(groups - others, groups).reshape(-1)


def informative_groups(scores: Tensor, group_size: int) -> Tensor:
    """(G,) bool: groups whose scores are not all equal. The others have zero advantage
    under every group baseline, so they teach nothing (DAPO's dynamic sampling drops them)."""
    return _informative(grouped(scores, group_size))


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ G_{t+1} over the counted tokens, (B, T), 0 where mask is 0: GAE
    with no critic (V = 0) and λ = 1, so masked positions are skipped the same way."""
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, lam=1.0)
    return returns


def outcome_scores(
    scores: Tensor, estimator: AdvantageEstimator, group_size: int, divide_by_std: bool
) -> Tensor:
    """(B,) the scores after the estimator's baseline (unchanged for gae and reinforce++)."""
    if estimator == "grpo":
        return group_normalized(scores, group_size, divide_by_std)
    if estimator == "rloo":
        return leave_one_out(scores, group_size)
    if estimator == "reinforce++-baseline":
        return group_normalized(scores, group_size, divide_by_std=False)
    return scores


@dataclass(frozen=True)
class Advantages:
    advantages: Tensor  # (B, T) for the policy loss
    returns: Tensor | None  # (B, T) the critic's regression targets; None without a critic
    kl: Tensor  # (B, T) per-token KL(π_old ‖ π_ref) estimate (0 without a ref)


def compute_advantages(
    scores: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor | None,
    values: Tensor | None,
    mask: Tensor,
    algorithm: AlgorithmConfig,
    group_size: int = 1,
    kl_coef: float | None = None,
    turn_rewards: Tensor | None = None,
) -> Advantages:
    """Scores (B,) and the scoring phase's per-token tensors (B, T) -> advantages, as
    `algorithm.advantageEstimator` says (module doc). `values` are the critic's (gae
    only). With `klMode: reward` the KL to the reference is a per-token reward penalty
    here, weighted by `kl_coef` (an adaptive controller's; unset: `algorithm.klCoef`);
    with `klMode: loss` it is left to the actor's loss and only reported. `turn_rewards`
    (B, T): a multi-turn episode's per-turn rewards (turn_rewards.py), added to the
    per-token rewards as they are, after the estimator's baseline on the scores."""
    estimator = algorithm.advantage_estimator
    if (values is None) == algorithm.uses_critic:
        raise ValueError(f"{estimator} {'needs' if algorithm.uses_critic else 'takes no'} values")
    kl = (
        kl_penalty(old_log_probs, ref_log_probs, algorithm.kl_estimator) * mask
        if ref_log_probs is not None
        else torch.zeros_like(mask)
    )
    in_reward = algorithm.kl_mode == "reward" and ref_log_probs is not None
    shaped = outcome_scores(scores, estimator, group_size, algorithm.normalize_group_std)
    coef = algorithm.kl_coef if kl_coef is None else kl_coef
    rewards = token_rewards(shaped, mask, kl if in_reward else None, coef)
    if turn_rewards is not None:
        rewards = rewards + turn_rewards * mask
    if values is not None:
        advantages, returns = gae(rewards, values, mask, algorithm.gamma, algorithm.lam)
        if algorithm.whiten_advantages:
            advantages = whiten(advantages, mask)
        return Advantages(advantages=advantages, returns=returns, kl=kl)
    advantages = discounted_returns(rewards, mask, algorithm.gamma)
    if estimator.startswith("reinforce++"):
        advantages = whiten(advantages, mask)
    return Advantages(advantages=advantages, returns=None, kl=kl)


def scored_mean(scores: Tensor) -> float:
    """The mean of (B,) scores over the samples that have one (NaN: unscored); NaN when
    none has: an unscored sample's 0 in the batch is a placeholder, not a reward."""
    scored = scores[~torch.isnan(scores)]
    return float(scored.mean()) if len(scored) else math.nan


def without_unscored(scores: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Samples with no reward (NaN: the reward service failed them) are not trained on:
    (B,) the scores with 0 in their place, and (B, T) the response mask with their rows
    0, as a cut episode's (its score 0 in its group's baseline, nothing of it counted)."""
    scored = ~torch.isnan(scores)
    kept = response_mask * scored.unsqueeze(1).to(response_mask.dtype)
    return torch.where(scored, scores, torch.zeros_like(scores)), kept
