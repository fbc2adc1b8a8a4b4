"""What an evaluation on held-out prompts reports, from the rewards of its responses.

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models
Trained on Code"): with n responses to a prompt of which c pass, the chance that k of
them drawn without replacement include a passing one is 1 - C(n-c, k) / C(n, k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that k of n responses (c of them passing), drawn without replacement,
    include a passing one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a passing one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvalScores:
    reward_mean: float
    pass_at_1: float
    pass_at_k: float | None  # k = the responses per prompt; None when that is 1
    response_length_mean: float


def eval_scores(rewards: torch.Tensor, lengths: torch.Tensor, pass_reward: float) -> EvalScores:
    """rewards, lengths: (P, n) for P prompts with n responses each. A response passes
    when its reward is at least `pass_reward`."""
    prompts, n = rewards.shape
    passing = (rewards >= pass_reward).sum(dim=1).tolist()  # (P,) c per prompt
    return EvalScores(
        reward_mean=float(rewards.float().mean()),
        pass_at_1=sum(pass_at_k(n, c, 1) for c in passing) / prompts,
        pass_at_k=sum(pass_at_k(n, c, n) for c in passing) / prompts if n > 1 else None,
        response_length_mean=float(lengths.float().mean()),
    )
