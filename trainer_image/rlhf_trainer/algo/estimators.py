"""Advantage estimators: from one score per response to per-token advantages.

    scores (B,) ─ outcome baseline ─▶ (B,) ─ token_rewards (+ KL, + turns' rewards) ─▶ (B, T)
          ─ GAE with the critic's values (gae) | returns-to-go (critic-free) ─▶ advantages
          ─ normalised: over the batch (gae if configured, reinforce++ always) ─▶

The critic-free estimators replace the critic's value baseline with one made from the
other responses to the same prompt (a group of n = samplesPerPrompt). A batch keeps a
group's rows together: rows g·n … g·n + n - 1 answer prompt g; or, when a data row gives
several samples (an agent episode's), each row says its group (`Groups`).

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


# A batch's groups: an int n, contiguous groups of n rows (rows g·n … g·n + n - 1 answer
# prompt g); or (B,) long, each row's group (an agent episode's samples, several a row).
Groups = int | Tensor


def group_index(groups: Groups, rows: int) -> Tensor:
    """(B,) long: each of `rows` rows' group, numbered 0 … G-1 in the order of the given
    numbers (so that per-group results come in that order)."""
    if isinstance(groups, int):
        if groups < 1 or rows % groups:
            raise ValueError(f"{rows} scores do not make groups of {groups}")
        return torch.arange(rows) // groups
    if groups.shape != (rows,):
        raise ValueError(f"{tuple(groups.shape)} group numbers for {rows} scores")
    numbers: Tensor = torch.unique(groups, return_inverse=True)[1]  # sorted: 0 … G-1
    return numbers


def _group_sum(values: Tensor, index: Tensor) -> Tensor:
    """(B,) values, (B,) group index -> (G,) each group's sum."""
    return _per_group(values, index).index_add_(0, index, values)


def _per_group(values: Tensor, index: Tensor) -> Tensor:
    """(G,) zeros of `values`' dtype, one per group of `index`."""
    return torch.zeros(int(index.max()) + 1 if len(index) else 0, dtype=values.dtype)


def group_normalized(scores: Tensor, groups: Groups, divide_by_std: bool = True) -> Tensor:
    """GRPO's outcome advantage, (B,): each score less its group's mean, divided by the
    group's standard deviation (Bessel-corrected, as in GRPO) unless `divide_by_std` is
    False (Dr. GRPO, which found the division biases towards easy and hard prompts)."""
    index = group_index(groups, len(scores))
    count = _group_sum(torch.ones_like(scores), index)  # (G,)
    centred = scores - (_group_sum(scores, index) / count)[index]
    if divide_by_std:  # a group of one has no spread: std 0 (its centred score is 0)
        std = (_group_sum(centred**2, index) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[index] + GROUP_STD_EPS)
    return zero_where_all_equal(centred, scores, index)


def zero_where_all_equal(advantages: Tensor, scores: Tensor, index: Tensor) -> Tensor:
    """(B,) advantages, exactly 0 in groups whose scores are all equal. Their float mean
    can be off by one ulp (0.7 or 1/3 in float32), and dividing that by std + eps would
    give the whole group a uniform advantage of up to ~0.1 instead of none."""
    return advantages.masked_fill(~_informative(scores, index)[index], 0.0)


def _informative(scores: Tensor, index: Tensor) -> Tensor:
    """(B,) scores, (B,) group index -> (G,) bool: the groups whose scores are not all equal."""
    empty = _per_group(scores, index)
    high = empty.scatter_reduce(0, index, scores, "amax", include_self=False)
    return high > empty.scatter_reduce(0, index, scores, "amin", include_self=False)


def leave_one_out(scores: Tensor, groups: Groups) -> Tensor:
    """RLOO's outcome advantage, (B,): each score less the mean of the other scores of
    its group. Needs groups of 2 or more."""
    index = group_index(groups, len(scores))
    count = _group_sum(torch.ones_like(scores), index)  # (G,)
    if len(count) and int(count.min()) < 2:
        raise ValueError(
            f"a leave-one-out baseline needs groups of 2 or more, got {int(count.min())}"
        )
    others = (_group_sum(scores, index)[index] - scores) / (count[index] - 1)
    return zero_where_all_equal(scores - others, scores, index)


def informative_groups(scores: Tensor, groups: Groups) -> Tensor:
    """(G,) bool: groups whose scores are not all equal. The others have zero advantage
    under every group baseline, so they teach nothing (DAPO's dynamic sampling drops them)."""
    return _informative(scores, group_index(groups, len(scores)))


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ G_{t+1} over the counted tokens, (B, T), 0 where mask is 0: GAE
    with no critic (V = 0) and λ = 1, so masked positions are skipped the same way."""
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, lam=1.0)
    return returns


def outcome_scores(
    scores: Tensor, estimator: AdvantageEstimator, groups: Groups, divide_by_std: bool
) -> Tensor:
    """(B,) the scores after the estimator's baseline (unchanged for gae and reinforce++)."""
    if estimator == "grpo":
        return group_normalized(scores, groups, divide_by_std)
    if estimator == "rloo":
        return leave_one_out(scores, groups)
    if estimator == "reinforce++-baseline":
        return group_normalized(scores, groups, divide_by_std=False)
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
    groups: Tensor | None = None,
) -> Advantages:
    """Scores (B,) and the scoring phase's per-token tensors (B, T) -> advantages, as
    `algorithm.advantageEstimator` says (module doc). `values` are the critic's (gae
    only). With `klMode: reward` the KL to the reference is a per-token reward penalty
    here, weighted by `kl_coef` (an adaptive controller's; unset: `algorithm.klCoef`);
    with `klMode: loss` it is left to the actor's loss and only reported. `turn_rewards`
    (B, T): a multi-turn episode's per-turn rewards (turn_rewards.py), added to the
    per-token rewards as they are, after the estimator's baseline on the scores.
    `groups` (B,): each row's group, for rows that are not `group_size` contiguous
    ones (an agent episode's samples); None: contiguous groups of `group_size`."""
    estimator = algorithm.advantage_estimator
    if (values is None) == algorithm.uses_critic:
        raise ValueError(f"{estimator} {'needs' if algorithm.uses_critic else 'takes no'} values")
    kl = (
        kl_penalty(old_log_probs, ref_log_probs, algorithm.kl_estimator) * mask
        if ref_log_probs is not None
        else torch.zeros_like(mask)
    )
    in_reward = algorithm.kl_mode == "reward" and ref_log_probs is not None
    grouping = group_size if groups is None else groups
    shaped = outcome_scores(scores, estimator, grouping, algorithm.normalize_group_std)
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
