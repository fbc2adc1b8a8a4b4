"""PPO maths as small pure tensor functions (no Ray, no vLLM, no model).

Every tensor is a batch of B responses padded to T tokens. `mask` (B, T) is 1 on the
response tokens that count and 0 elsewhere (padding; it may also have holes, e.g.
tool output inside a multi-turn response, which then takes no part in the maths).
Position t of `log_probs` is log π(a_t | s_t): the log-prob of response token t given
the prompt and the tokens before it.

The functions return per-token tensors; `aggregate` turns one into the scalar loss,
so each loss term can be mixed and logged on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k3"]


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the positions where mask is 1; 0 (not NaN) where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x to zero mean and unit variance over the masked positions of the batch.

    Population variance (no Bessel correction), like OpenRLHF. Masked-out positions are
    0 afterwards. shift_mean=False keeps the mean and only rescales (some setups whiten
    rewards this way, so their sign survives).
    """
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


GAE_CHUNK = 64  # tokens per matrix product in `discounted_reverse_cumsum`


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, chunk: int = GAE_CHUNK
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the response tokens.

    rewards: (B, T) per-token rewards r_t (the score on the last token, KL penalties
    on every token); values: (B, T) V(s_t) from the critic; mask: (B, T).
    Returns (advantages, returns), both (B, T) and 0 where mask is 0.

    A_t = δ_t + γλ A_{t+1},  δ_t = r_t + γ V(s_{t+1}) - V(s_t), with V = 0 and A = 0 past
    the last response token (the episode ends there). Masked positions are skipped:
    the "next" token of t is the next position where mask is 1, and their rewards are
    ignored. returns = A + V, the critic's regression target (λ-return).

    Each row's counted tokens are moved to its front, in order, so the recursion runs
    over them alone; then A is a discounted sum of the δs ahead, taken `chunk` tokens at
    a time (`discounted_reverse_cumsum`): T / chunk steps rather than one per token.
    """
    order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)  # (B, T)
    counted = (mask.gather(1, order) != 0).to(rewards.dtype)  # (B, T): a prefix of each row
    r = rewards.gather(1, order) * counted
    v = values.gather(1, order) * counted
    next_v = torch.cat([v[:, 1:], v.new_zeros(len(v), 1)], dim=1)  # 0 past the last token
    deltas = (r + gamma * next_v - v) * counted
    advantages = torch.zeros_like(rewards).scatter(
        1, order, discounted_reverse_cumsum(deltas, gamma * lam, chunk)
    )
    returns = (advantages + values) * mask
    return advantages, returns


def discounted_reverse_cumsum(x: Tensor, discount: float, chunk: int = GAE_CHUNK) -> Tensor:
    """y_t = Σ_{j ≥ t} discount^(j - t) x_j along the last dimension of (B, T).

    Within a chunk of c tokens this is one product with the (c, c) matrix of
    discount^(j - t) for j ≥ t; the chunks after add discount^(end - t) times the sum
    already taken at the next chunk's first token, end being that token's position.
    """
    steps = torch.arange(chunk, dtype=x.dtype, device=x.device)
    lag = steps[:, None] - steps[None, :]  # (c, c): j - t
    weights = torch.where(lag >= 0, discount ** lag.clamp(min=0), torch.zeros_like(lag))
    carry_weights = discount ** (steps + 1)  # discount^1 … discount^c
    out = torch.empty_like(x)
    carry = x.new_zeros(x.shape[:-1])  # (B,) y at the next chunk's first token
    for start in reversed(range(0, x.shape[-1], chunk)):
        n = min(chunk, x.shape[-1] - start)
        from_later = carry[..., None] * carry_weights[:n].flip(0)  # discount^(n - t) y_end
        y = x[..., start : start + n] @ weights[:n, :n] + from_later
        out[..., start : start + n] = y
        carry = y[..., 0]
    return out


def last_token_index(mask: Tensor) -> Tensor:
    """(B,) index of the last position where mask is 1 (0 for an all-masked row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, 0).amax(dim=1)


def token_rewards(
    scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards for GAE: the sequence score on the last response token, and
    (KL in the reward) -kl_coef · KL_t on every response token.

    scores: (B,) one reward per response; kl: (B, T) from `kl_penalty`. An all-masked
    row gets no reward at all (it has no token to put it on).
    """
    rewards = torch.zeros_like(mask, dtype=scores.dtype)  # (B, T)
    has_tokens = mask.sum(dim=1) > 0  # (B,)
    rewards[torch.arange(len(scores)), last_token_index(mask)] = torch.where(
        has_tokens, scores, 0.0
    )
    if kl is not None:
        rewards = rewards - kl_coef * kl
    return rewards * mask


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π, (B, T).

    k1 = log π - log π_ref: unbiased, can be negative per token (the usual reward
    penalty). k3 = r - 1 - log r with r = π_ref/π: unbiased, always ≥ 0 and lower
    variance (Schulman, "Approximating KL divergence"); the usual choice for a KL loss.
    """
    log_ratio = log_probs - ref_log_probs  # (B, T) log π/π_ref
    if estimator == "k1":
        return log_ratio
    return torch.expm1(-log_ratio) + log_ratio  # exp(-x) - 1 + x, exact near x = 0


@dataclass(frozen=True)
class PolicyLoss:
    loss: Tensor  # (B, T) per-token clipped surrogate loss (to minimise)
    clipped: Tensor  # (B, T) bool: the clipped branch set the loss (no gradient there)
    ratio: Tensor  # (B, T) π/π_old


def clipped_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate, per token: max(-A·ρ, -A·clip(ρ, 1-ε_low, 1+ε_high)).

    log_probs: (B, T) log π(a|s) of the policy being updated (with gradient);
    old_log_probs: (B, T) log π_old(a|s) when the batch was scored.
    clip_high: None is the symmetric clip (ε_high = ε_low). A larger ε_high (DAPO's
    clip-higher) lets unlikely tokens with positive advantage grow further, which keeps
    the policy's entropy from collapsing.
    Dual clip (Ye et al. 2020, c > 1): for A < 0 the loss is also capped at -c·A, so a
    huge ratio on a bad action (a stale or unlucky sample) cannot blow the step up.
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(log_probs - old_log_probs)  # (B, T) ρ = π/π_old
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual_active = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
        clip_active = clip_active | dual_active
    return PolicyLoss(loss=loss, clipped=clip_active, ratio=ratio)


@dataclass(frozen=True)
class ValueLoss:
    loss: Tensor  # (B, T) per-token value loss (to minimise)
    clipped: Tensor  # (B, T) bool: the clipped value set the loss (no gradient there)


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None
) -> ValueLoss:
    """Per-token value loss ½·max((V - R)², (V_clip - R)²), (B, T).

    V_clip = V_old + clip(V - V_old, -δ, δ) keeps the critic near the values the
    advantages were computed with; value_clip=None is the plain ½(V - R)².
    """
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return ValueLoss(loss=0.5 * unclipped, clipped=torch.zeros_like(values, dtype=torch.bool))
    values_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    clipped = (values_clipped - returns) ** 2
    return ValueLoss(loss=0.5 * torch.maximum(unclipped, clipped), clipped=clipped > unclipped)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 when the values predict the
    returns, 0 when they do no better than their mean, negative when worse. NaN when the
    returns do not vary (there is nothing to explain)."""
    returns_var = masked_var(returns, mask)
    return float(1.0 - masked_var(returns - values, mask) / returns_var)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """The (population) variance of x over the masked entries."""
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask)


def approx_kl(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_old ‖ π) from samples of π_old, (B, T): how far an
    update moved the policy (r - 1 - log r with r = π/π_old; ≥ 0)."""
    return kl_penalty(old_log_probs, log_probs, "k3")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at every position: (B, T, V) -> (B, T).

    H = logsumexp(z) - Σ softmax(z)·z, which avoids materialising log-softmax twice.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def log_probs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log π(token_t) under logits_t: (B, T, V) and (B, T) -> (B, T).

    The caller aligns them: logits at position t must predict tokens[:, t] (for a causal
    LM that is the model output at t - 1).
    """
    log_softmax = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    return log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def log_probs_and_entropy(
    logits: Tensor, tokens: Tensor, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """`log_probs_from_logits` and `entropy_from_logits` from one log-softmax:
    (B, T, V) and (B, T) -> (B, T), (B, T). H = -Σ exp(log π)·log π, on the log-softmax
    the log-probs need anyway (the two apart take a softmax, a logsumexp and their
    product more). Without `entropy_grad` the entropy is a report: no graph is kept."""
    log_softmax = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    log_probs = log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    return log_probs, entropy


def aggregate(
    loss: Tensor, mask: Tensor, mode: LossAggregation, normalizer: float | Tensor | None = None
) -> Tensor:
    """One scalar from per-token losses (B, T), as AlgorithmConfig.loss_aggregation says.

    token-mean: every token of the batch weighs the same (long responses weigh more).
    seq-mean-token-mean: each response weighs the same, its tokens averaged.
    seq-mean-token-sum: each response weighs the same, its tokens summed (Dr. GRPO-like:
    no length normalisation). The sequence means skip responses with no counted token;
    a batch with none gives 0, not NaN.

    normalizer: when a mini-batch is split into micro-batches (or over data-parallel
    ranks), pass `aggregation_normalizer` of the whole mini-batch, so the micro-batch
    losses add up to the mini-batch's loss instead of averaging unequal averages.
    """
    if mode == "token-mean":
        numerator = masked_sum(loss, mask)
    else:
        per_sequence = (
            masked_mean(loss, mask, dim=1)
            if mode == "seq-mean-token-mean"
            else masked_sum(loss, mask, 1)
        )  # (B,)
        numerator = per_sequence.sum()  # empty rows add 0
    if normalizer is None:
        normalizer = aggregation_normalizer(mask, mode)
    return numerator / max(float(normalizer), 1.0)


def aggregation_normalizer(mask: Tensor, mode: LossAggregation) -> Tensor:
    """What `aggregate` divides by: counted tokens (token-mean) or responses with at
    least one counted token (the sequence modes)."""
    if mode == "token-mean":
        return mask.sum()
    return (mask.sum(dim=1) > 0).sum()


@dataclass(frozen=True)
class ImportanceWeights:
    weights: Tensor  # (B, T) min(π_trainer/π_rollout, cap), no gradient, 0 where masked
    clipped_fraction: Tensor  # () share of counted tokens whose ratio exceeded the cap


def truncated_importance_weights(
    trainer_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, cap: float
) -> ImportanceWeights:
    """Truncated importance sampling between the trainer's and the rollout's policy.

    The rollout engine sampled with its own (possibly stale, and numerically different)
    log-probs; weighting each token's loss by min(π_trainer/π_rollout, cap) corrects
    that bias while the cap bounds the variance. The weights are constants (detached).
    """
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    log_ratio = (trainer_log_probs - rollout_log_probs).detach()  # (B, T)
    ratio = torch.exp(log_ratio)
    over_cap = (ratio > cap).to(mask.dtype)
    return ImportanceWeights(
        weights=torch.clamp(ratio, max=cap) * mask,
        clipped_fraction=masked_mean(over_cap, mask),
    )
