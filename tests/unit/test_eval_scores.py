"""pass@k and the held-out evaluation's scores, against naive versions."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from rlhf_trainer.algo.eval_scores import eval_scores, pass_at_k


def naive_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of all k-subsets of the responses that hold a passing one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(naive_pass_at_k(outcomes, k)), (n, c, k)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match=f"n={n} c={c} k={k}"):
            pass_at_k(n, c, k)


def test_eval_scores_match_a_loop_over_prompts() -> None:
    rng = random.Random(0)
    prompts, n, threshold = 7, 4, 0.5
    rewards = torch.tensor(
        [[rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)] for _ in range(prompts)]
    )
    lengths = torch.randint(1, 20, (prompts, n))
    scores = eval_scores(rewards, lengths, threshold)
    passes = [[float(r) >= threshold for r in row] for row in rewards]
    assert scores.reward_mean == pytest.approx(sum(map(sum, rewards.tolist())) / (prompts * n))
    assert scores.pass_at_1 == pytest.approx(sum(map(sum, passes)) / (prompts * n))
    assert scores.pass_at_k == pytest.approx(sum(any(row) for row in passes) / prompts)
    assert scores.response_length_mean == pytest.approx(float(lengths.float().mean()))


def test_one_response_per_prompt_has_no_pass_at_k() -> None:
    scores = eval_scores(torch.tensor([[1.0], [0.0]]), torch.tensor([[3], [5]]), 1.0)
    assert scores.pass_at_1 == 0.5 and scores.pass_at_k is None
