"""The critic-free advantage estimators against naive references (loops over groups and
tokens, plain Python floats), including the awkward groups: all rewards equal, and n = 2."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlhf_trainer.algo import estimators
from rlhf_trainer.algo.estimators import compute_advantages
from rlhf_trainer.api.algorithm import AlgorithmConfig

SEEDS = range(8)


def naive_group_baseline(scores: list[float], n: int, kind: str, divide: bool) -> list[float]:
    out = []
    for start in range(0, len(scores), n):
        group = scores[start : start + n]
        mean = sum(group) / n
        for i, r in enumerate(group):
            if kind == "rloo":
                out.append(r - (sum(group) - group[i]) / (n - 1))
            elif divide:
                out.append((r - mean) / (statistics.stdev(group) + estimators.GROUP_STD_EPS))
            else:
                out.append(r - mean)
    return out


def random_scores(seed: int, n: int, groups: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (groups * n,), generator=generator).double() / 2
    scores[:n] = 0.5  # one group whose rewards are all equal
    return scores


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize(("kind", "divide"), [("grpo", True), ("grpo", False), ("rloo", True)])
def test_group_baselines_match_the_naive_reference(
    seed: int, n: int, kind: str, divide: bool
) -> None:
    scores = random_scores(seed, n, groups=4)
    if kind == "rloo":
        actual = estimators.leave_one_out(scores, n)
    else:
        actual = estimators.group_normalized(scores, n, divide)
    expected = naive_group_baseline(scores.tolist(), n, kind, divide)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=scores.dtype))
    assert actual[:n].tolist() == [0.0] * n  # the all-equal group: zero, not NaN


def test_a_group_of_two_gets_plus_and_minus_one_from_grpo_and_the_difference_from_rloo() -> None:
    scores = torch.tensor([1.0, 0.0, 0.3, 0.3])
    grpo = estimators.group_normalized(scores, 2)
    # std of {1, 0} (Bessel) is 1/sqrt(2): the normalised scores are ±1/sqrt(2)
    torch.testing.assert_close(grpo, torch.tensor([1, -1, 0, 0]) / math.sqrt(2), atol=1e-5, rtol=0)
    rloo = estimators.leave_one_out(scores, 2)
    torch.testing.assert_close(rloo, torch.tensor([1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("reward", [0.1, 0.7, 1 / 3])
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++-baseline"])
@pytest.mark.parametrize("divide", [True, False])
def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_their_float(
    n: int, reward: float, estimator: str, divide: bool
) -> None:
    # float32's mean of n copies of 0.7 or 1/3 can be off by one ulp; divided by
    # std + eps, that once gave the whole group a uniform advantage of up to ~0.1.
    scores = torch.tensor([reward] * n + [0.0] * (n - 1) + [1.0], dtype=torch.float32)
    shaped = estimators.outcome_scores(scores, estimator, n, divide)  # type: ignore[arg-type]
    assert shaped[:n].tolist() == [0.0] * n
    assert shaped[n:].abs().sum() > 0  # the informative group keeps its advantage


def test_informative_groups_are_those_whose_rewards_differ() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert estimators.informative_groups(scores, 2).tolist() == [False, True, False]


def test_scores_that_do_not_fill_whole_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="groups of 2"):
        estimators.group_normalized(torch.ones(3), 2)
    with pytest.raises(ValueError, match="2 or more"):
        estimators.leave_one_out(torch.ones(3), 1)


def random_batch(seed: int, n: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    rows, length = 3 * n, 6
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    mask[1, 0] = 0.0  # a hole
    log_probs = torch.randn(rows, length, generator=generator, dtype=torch.float64) * mask
    ref = torch.randn(rows, length, generator=generator, dtype=torch.float64) * mask
    return random_scores(seed, n, groups=3), log_probs, ref, mask


def naive_critic_free(
    scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref: torch.Tensor,
    mask: torch.Tensor,
    algorithm: AlgorithmConfig,
    n: int,
) -> list[list[float]]:
    """Outcome baseline per group, then per row: reward -coef·(logp - ref) on each token
    and the shaped score on the last; returns-to-go; reinforce++ normalises globally."""
    estimator = algorithm.advantage_estimator
    raw = scores.tolist()
    if estimator in ("grpo", "rloo"):
        shaped = naive_group_baseline(raw, n, estimator, algorithm.normalize_group_std)
    elif estimator == "reinforce++-baseline":
        shaped = naive_group_baseline(raw, n, "grpo", divide=False)
    else:
        shaped = raw
    out = [[0.0] * mask.shape[1] for _ in raw]
    for row, score in enumerate(shaped):
        positions = [t for t in range(mask.shape[1]) if mask[row, t]]
        if not positions:
            continue  # an empty response: nothing to put the score on
        rewards = [-algorithm.kl_coef * float(log_probs[row, t] - ref[row, t]) for t in positions]
        rewards[-1] += score
        running = 0.0
        for i in reversed(range(len(positions))):
            running = rewards[i] + algorithm.gamma * running
            out[row][positions[i]] = running
    if estimator.startswith("reinforce++"):
        counted = [out[r][t] for r in range(len(raw)) for t in range(mask.shape[1]) if mask[r, t]]
        mean = sum(counted) / len(counted)
        std = math.sqrt(sum((x - mean) ** 2 for x in counted) / len(counted) + 1e-8)
        out = [
            [(x - mean) / std if mask[r, t] else 0.0 for t, x in enumerate(row)]
            for r, row in enumerate(out)
        ]
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++", "reinforce++-baseline"])
def test_critic_free_advantages_match_the_naive_reference(seed: int, estimator: str) -> None:
    n = 2 + seed % 3
    scores, log_probs, ref, mask = random_batch(seed, n)
    algorithm = AlgorithmConfig(
        advantage_estimator=estimator,  # type: ignore[arg-type]
        gamma=[1.0, 0.9][seed % 2],
        kl_coef=0.1,
        normalize_group_std=seed % 4 != 1,
    )
    result = compute_advantages(scores, log_probs, ref, None, mask, algorithm, group_size=n)
    expected = naive_critic_free(scores, log_probs, ref, mask, algorithm, n)
    torch.testing.assert_close(result.advantages, torch.tensor(expected, dtype=torch.float64))
    assert result.returns is None
    assert torch.isfinite(result.advantages).all()


def test_grpo_with_kl_in_the_loss_gives_every_token_of_a_response_its_group_advantage() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    algorithm = AlgorithmConfig(advantage_estimator="grpo", kl_mode="loss")
    lp = torch.randn(4, 3)
    result = compute_advantages(scores, lp, lp + 1, None, mask, algorithm, group_size=2)
    per_row = estimators.group_normalized(scores, 2)
    torch.testing.assert_close(result.advantages, per_row[:, None] * mask)
    assert result.kl.abs().sum() > 0  # reported, not in the advantages


def test_the_estimator_and_the_values_must_agree() -> None:
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="gae needs values"):
        compute_advantages(torch.ones(2), mask, None, None, mask, AlgorithmConfig())
    with pytest.raises(ValueError, match="grpo takes no values"):
        compute_advantages(
            torch.ones(2), mask, None, mask, mask, AlgorithmConfig(advantage_estimator="grpo"), 2
        )


def test_an_unscored_sample_is_not_trained_on_and_scores_0_in_its_groups_baseline() -> None:
    """NaN: a sample the reward service failed. Unmasked, it would make every advantage
    of its group NaN, and with it the whole batch's loss."""
    scores = torch.tensor([1.0, math.nan, 0.5, 0.0])
    mask = torch.ones(4, 3)
    kept, masked = estimators.without_unscored(scores, mask)
    assert kept.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert masked.tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert mask.sum() == 12  # the caller's mask is left as it was
    grpo = AlgorithmConfig(advantage_estimator="grpo", kl_mode="loss")
    zeros = torch.zeros(4, 3)
    advantages = compute_advantages(kept, zeros, zeros, None, masked, grpo, 2, 0.0)
    assert torch.isfinite(advantages.advantages).all()
    assert advantages.advantages[1].abs().sum() == 0  # masked: nothing of it counts


@pytest.mark.parametrize(
    "scores",
    [[1.0, math.nan, 0.5, 0.0], [0.25], [math.nan, 2.0], [math.nan, math.nan], [-1.0, 3.0, 0.5]],
)
def test_the_mean_reward_is_over_the_scored_samples_alone(scores: list[float]) -> None:
    """Against a naive mean: an unscored sample's 0 placeholder is no reward (a step
    with none scored has no mean, not 0)."""
    scored = [s for s in scores if not math.isnan(s)]
    mean = estimators.scored_mean(torch.tensor(scores))
    if scored:
        assert mean == pytest.approx(statistics.fmean(scored))
    else:
        assert math.isnan(mean)
