"""PPO maths against naive reference implementations (plain Python loops over floats).

Each reference follows the textbook definition one token at a time, so it shares no
vectorisation trick with rlhf_trainer.ppo. Random cases are seeded and include the
awkward masks: right padding, holes in the middle, all-masked rows, one-token rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_trainer.algo import ppo

Rows = list[list[float]]

SEEDS = range(12)
ATOL = 1e-5


def random_mask(generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Right-padded rows of random length, some with holes, one all-masked row."""
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    holes = torch.rand(batch, length, generator=generator) < 0.15
    mask = mask * (~holes)
    mask[0] = 0.0  # an all-masked row (e.g. a prompt that produced nothing)
    mask[-1, 0] = 1.0  # and at least one row with a first token
    return mask


def random_case(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, length = 2 + seed % 4, 1 + seed % 9

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return {
        "mask": random_mask(generator, batch, length).double(),
        "rewards": normal(batch, length),
        "values": normal(batch, length),
        "old_values": normal(batch, length),
        "returns": normal(batch, length),
        "log_probs": -normal(batch, length).abs(),
        "old_log_probs": -normal(batch, length).abs(),
        "advantages": normal(batch, length),
        "logits": 3 * normal(batch, length, 7),
        "scores": normal(batch),
    }


def rows(x: torch.Tensor) -> Rows:
    return [[float(v) for v in row] for row in x.tolist()]


def counted(mask: Rows, b: int) -> list[int]:
    return [t for t, m in enumerate(mask[b]) if m]


# --- the references ---------------------------------------------------------------


def ref_gae(rewards: Rows, values: Rows, mask: Rows, gamma: float, lam: float) -> tuple[Rows, Rows]:
    """Per row: keep only the counted tokens, then A_t = Σ_l (γλ)^l δ_{t+l}."""
    advantages = [[0.0] * len(row) for row in rewards]
    returns = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        steps = counted(mask, b)
        r = [rewards[b][t] for t in steps]
        v = [values[b][t] for t in steps]
        deltas = [
            r[i] + gamma * (v[i + 1] if i + 1 < len(v) else 0.0) - v[i] for i in range(len(v))
        ]
        for i, t in enumerate(steps):
            a = sum((gamma * lam) ** k * deltas[i + k] for k in range(len(deltas) - i))
            advantages[b][t] = a
            returns[b][t] = a + v[i]
    return advantages, returns


def ref_whiten(x: Rows, mask: Rows) -> Rows:
    flat = [x[b][t] for b in range(len(x)) for t in counted(mask, b)]
    mean = sum(flat) / len(flat)
    variance = sum((v - mean) ** 2 for v in flat) / len(flat)
    return [
        [
            (v - mean) / math.sqrt(variance + 1e-8) if m else 0.0
            for v, m in zip(row, mrow, strict=True)
        ]
        for row, mrow in zip(x, mask, strict=True)
    ]


def ref_policy_loss(
    lp: float, old: float, a: float, low: float, high: float, c: float | None
) -> float:
    ratio = math.exp(lp - old)
    loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss


def ref_value_loss(v: float, old: float, ret: float, clip: float | None) -> tuple[float, bool]:
    """The loss, and whether the clipped value set it."""
    if clip is None:
        return 0.5 * (v - ret) ** 2, False
    v_clipped = old + min(max(v - old, -clip), clip)
    return 0.5 * max((v - ret) ** 2, (v_clipped - ret) ** 2), (v_clipped - ret) ** 2 > (
        v - ret
    ) ** 2


def ref_explained_variance(values: Rows, returns: Rows, mask: Rows) -> float:
    counted_tokens = [
        (v, r)
        for vs, rs, ms in zip(values, returns, mask, strict=True)
        for v, r, m in zip(vs, rs, ms, strict=True)
        if m
    ]

    def variance(xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    residuals = variance([r - v for v, r in counted_tokens])
    return 1 - residuals / variance([r for _, r in counted_tokens])


def ref_kl(lp: float, ref: float, estimator: str) -> float:
    if estimator == "k1":
        return lp - ref
    r = math.exp(ref - lp)
    return r - 1 - math.log(r)


def ref_entropy(z: list[float]) -> float:
    top = max(z)
    total = sum(math.exp(v - top) for v in z)
    probs = [math.exp(v - top) / total for v in z]
    return -sum(p * math.log(p) for p in probs if p > 0)


def ref_aggregate(loss: Rows, mask: Rows, mode: str) -> float:
    if mode == "token-mean":
        values = [loss[b][t] for b in range(len(loss)) for t in counted(mask, b)]
        return sum(values) / len(values) if values else 0.0
    per_sequence = []
    for b in range(len(loss)):
        steps = counted(mask, b)
        if not steps:
            continue
        total = sum(loss[b][t] for t in steps)
        per_sequence.append(total / len(steps) if mode == "seq-mean-token-mean" else total)
    return sum(per_sequence) / len(per_sequence) if per_sequence else 0.0


def assert_rows_close(actual: torch.Tensor, expected: Rows) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=0
    )


# --- random cases against the references -------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.5, 0.0)])
def test_gae_matches_reference(seed: int, gamma: float, lam: float) -> None:
    case = random_case(seed)
    advantages, returns = ppo.gae(case["rewards"], case["values"], case["mask"], gamma, lam)
    expected_adv, expected_ret = ref_gae(
        rows(case["rewards"]), rows(case["values"]), rows(case["mask"]), gamma, lam
    )
    assert_rows_close(advantages, expected_adv)
    assert_rows_close(returns, expected_ret)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("chunk", [1, 3, ppo.GAE_CHUNK])
def test_gae_over_rows_longer_than_a_chunk_matches_reference(seed: int, chunk: int) -> None:
    """The sums carried from chunk to chunk: rows of 20 to 163 tokens, with holes."""
    generator = torch.Generator().manual_seed(seed)
    batch, length = 3, 20 + 13 * seed
    mask = random_mask(generator, batch, length).double()
    rewards, values = (
        torch.randn(batch, length, generator=generator, dtype=torch.float64) for _ in range(2)
    )
    advantages, returns = ppo.gae(rewards, values, mask, 0.99, 0.95, chunk=chunk)
    expected_adv, expected_ret = ref_gae(rows(rewards), rows(values), rows(mask), 0.99, 0.95)
    assert_rows_close(advantages, expected_adv)
    assert_rows_close(returns, expected_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_whiten_matches_reference(seed: int) -> None:
    case = random_case(seed)
    whitened = ppo.whiten(case["advantages"], case["mask"])
    assert_rows_close(whitened, ref_whiten(rows(case["advantages"]), rows(case["mask"])))
    assert float(ppo.masked_mean(whitened, case["mask"])) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("low", "high", "dual_clip"),
    [(0.2, 0.2, None), (0.2, 0.2, 3.0), (0.1, 0.1, 1.5), (0.2, 0.28, None), (0.1, 0.5, 2.0)],
)
def test_clipped_policy_loss_matches_reference(
    seed: int, low: float, high: float, dual_clip: float | None
) -> None:
    case = random_case(seed)
    result = ppo.clipped_policy_loss(
        case["log_probs"], case["old_log_probs"], case["advantages"], low, high, dual_clip
    )
    expected = [
        [ref_policy_loss(lp, old, a, low, high, dual_clip) for lp, old, a in zip(*r, strict=True)]
        for r in zip(
            rows(case["log_probs"]),
            rows(case["old_log_probs"]),
            rows(case["advantages"]),
            strict=True,
        )
    ]
    assert_rows_close(result.loss, expected)
    # Where the clipped branch sets the loss, the gradient w.r.t. log π is zero.
    log_probs = case["log_probs"].clone().requires_grad_()
    again = ppo.clipped_policy_loss(
        log_probs, case["old_log_probs"], case["advantages"], low, high, dual_clip
    )
    again.loss.sum().backward()
    assert log_probs.grad is not None
    assert torch.all(log_probs.grad[again.clipped] == 0)
    assert torch.all(log_probs.grad[~again.clipped & (case["advantages"] != 0)] != 0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("value_clip", [None, 0.2, 1.0])
def test_clipped_value_loss_matches_reference(seed: int, value_clip: float | None) -> None:
    case = random_case(seed)
    value = ppo.clipped_value_loss(case["values"], case["old_values"], case["returns"], value_clip)
    expected = [
        [ref_value_loss(v, old, ret, value_clip) for v, old, ret in zip(*r, strict=True)]
        for r in zip(
            rows(case["values"]), rows(case["old_values"]), rows(case["returns"]), strict=True
        )
    ]
    assert_rows_close(value.loss, [[loss for loss, _ in row] for row in expected])
    assert value.clipped.tolist() == [[clipped for _, clipped in row] for row in expected]


@pytest.mark.parametrize("seed", SEEDS)
def test_explained_variance_matches_reference(seed: int) -> None:
    case = random_case(seed)
    mask = case["mask"]
    if mask.sum() < 2:
        mask = torch.ones_like(mask)  # a variance needs two tokens
    values, returns = case["values"], case["returns"]
    expected = ref_explained_variance(rows(values), rows(returns), rows(mask))
    assert ppo.explained_variance(values, returns, mask) == pytest.approx(expected, abs=1e-9)
    assert ppo.explained_variance(returns, returns, mask) == pytest.approx(1.0)


def test_approx_kl_is_k3_of_the_old_policy_against_the_new() -> None:
    log_probs, old = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.2, -0.5]])
    expected = [
        [ref_kl(o, lp, "k3") for lp, o in zip(log_probs[0].tolist(), old[0].tolist(), strict=True)]
    ]
    assert_rows_close(ppo.approx_kl(log_probs, old), expected)
    assert float(ppo.approx_kl(log_probs, old)[0, 1]) == 0.0  # no change, no KL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_matches_reference(seed: int, estimator: ppo.KLEstimator) -> None:
    case = random_case(seed)
    kl = ppo.kl_penalty(case["log_probs"], case["old_log_probs"], estimator)
    expected = [
        [ref_kl(lp, ref, estimator) for lp, ref in zip(*r, strict=True)]
        for r in zip(rows(case["log_probs"]), rows(case["old_log_probs"]), strict=True)
    ]
    assert_rows_close(kl, expected)
    if estimator == "k3":
        assert torch.all(kl >= 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_token_rewards_put_the_score_on_the_last_token_and_kl_everywhere(seed: int) -> None:
    case = random_case(seed)
    kl = ppo.kl_penalty(case["log_probs"], case["old_log_probs"], "k1")
    rewards = ppo.token_rewards(case["scores"], case["mask"], kl, kl_coef=0.1)
    mask, kl_rows, scores = rows(case["mask"]), rows(kl), case["scores"].tolist()
    expected = [[0.0] * len(row) for row in mask]
    for b in range(len(mask)):
        steps = counted(mask, b)
        for t in steps:
            expected[b][t] = -0.1 * kl_rows[b][t]
        if steps:
            expected[b][steps[-1]] += scores[b]
    assert_rows_close(rewards, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_from_logits_matches_reference(seed: int) -> None:
    logits = random_case(seed)["logits"]
    expected = [[ref_entropy(z) for z in row] for row in logits.tolist()]
    assert_rows_close(ppo.entropy_from_logits(logits), expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_log_probs_from_logits_matches_reference(seed: int) -> None:
    logits = random_case(seed)["logits"]
    tokens = torch.randint(
        0, logits.shape[-1], logits.shape[:2], generator=torch.Generator().manual_seed(seed)
    )
    expected = [
        [
            z[k] - max(z) - math.log(sum(math.exp(v - max(z)) for v in z))
            for z, k in zip(zs, ks, strict=True)
        ]
        for zs, ks in zip(logits.tolist(), tokens.tolist(), strict=True)
    ]
    assert_rows_close(ppo.log_probs_from_logits(logits, tokens).double(), expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregate_matches_reference(seed: int, mode: ppo.LossAggregation) -> None:
    case = random_case(seed)
    loss = ppo.aggregate(case["rewards"], case["mask"], mode)
    assert float(loss) == pytest.approx(
        ref_aggregate(rows(case["rewards"]), rows(case["mask"]), mode), abs=ATOL
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cap", [1.0, 1.2, 2.0])
def test_truncated_importance_weights_match_reference(seed: int, cap: float) -> None:
    case = random_case(seed)
    trainer = case["log_probs"].clone().requires_grad_()
    result = ppo.truncated_importance_weights(trainer, case["old_log_probs"], case["mask"], cap)
    mask = rows(case["mask"])
    ratios = [
        [math.exp(a - b) for a, b in zip(*r, strict=True)]
        for r in zip(rows(case["log_probs"]), rows(case["old_log_probs"]), strict=True)
    ]
    expected = [
        [min(q, cap) * m for q, m in zip(*r, strict=True)] for r in zip(ratios, mask, strict=True)
    ]
    assert_rows_close(result.weights, expected)
    flags = [ratios[b][t] > cap for b in range(len(mask)) for t in counted(mask, b)]
    assert float(result.clipped_fraction) == pytest.approx(sum(flags) / len(flags))
    assert not result.weights.requires_grad


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_losses_add_up_to_the_mini_batch_loss(
    seed: int, mode: ppo.LossAggregation
) -> None:
    case = random_case(seed)
    loss, mask = case["rewards"], case["mask"]
    whole = ppo.aggregate(loss, mask, mode)
    normalizer = ppo.aggregation_normalizer(mask, mode)
    parts = [
        ppo.aggregate(loss[i : i + 2], mask[i : i + 2], mode, normalizer)
        for i in range(0, len(loss), 2)
    ]
    assert float(sum(parts)) == pytest.approx(float(whole), abs=ATOL)


# --- hand-computed edge cases --------------------------------------------------------


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, -1.0, 2.0, 3.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 9.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    advantages, returns = ppo.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = torch.tensor([[1.0, 1.0, 1.0, 0.0], [4.5, 4.0, 5.0, 3.0]])
    torch.testing.assert_close(returns, reward_to_go)
    torch.testing.assert_close(advantages, (reward_to_go - values) * mask)


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.25, 1.0]])
    advantages, _ = ppo.gae(rewards, values, torch.ones(1, 3), gamma=0.5, lam=0.0)
    # δ_t = r_t + γ V_{t+1} - V_t, and V = 0 after the last token.
    torch.testing.assert_close(
        advantages, torch.tensor([[1.0 + 0.125 - 0.5, 2.0 + 0.5 - 0.25, 2.0]])
    )


def test_all_masked_rows_give_zeros_not_nans() -> None:
    mask = torch.zeros(2, 3)
    x = torch.randn(2, 3)
    advantages, returns = ppo.gae(x, x, mask, 1.0, 0.95)
    assert torch.all(advantages == 0) and torch.all(returns == 0)
    assert torch.all(ppo.whiten(x, mask) == 0)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert float(ppo.aggregate(x, mask, mode)) == 0.0
    assert torch.all(ppo.token_rewards(torch.tensor([1.0, 2.0]), mask) == 0)
    weights = ppo.truncated_importance_weights(x, x, mask, 2.0)
    assert torch.all(weights.weights == 0) and float(weights.clipped_fraction) == 0.0


def test_aggregation_modes_weigh_long_and_short_responses_differently() -> None:
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert float(ppo.aggregate(loss, mask, "token-mean")) == pytest.approx(8 / 5)
    assert float(ppo.aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx((1 + 4) / 2)
    assert float(ppo.aggregate(loss, mask, "seq-mean-token-sum")) == pytest.approx((4 + 4) / 2)


def test_dual_clip_bounds_the_loss_of_a_negative_advantage() -> None:
    old = torch.zeros(1, 3)
    log_probs = torch.log(torch.tensor([[10.0, 1.1, 0.5]]))  # ratios 10, 1.1, 0.5
    advantages = torch.tensor([[-1.0, -1.0, 1.0]])
    plain = ppo.clipped_policy_loss(log_probs, old, advantages, clip_low=0.2)
    dual = ppo.clipped_policy_loss(log_probs, old, advantages, clip_low=0.2, dual_clip=3.0)
    torch.testing.assert_close(plain.loss, torch.tensor([[10.0, 1.1, -0.5]]))
    torch.testing.assert_close(dual.loss, torch.tensor([[3.0, 1.1, -0.5]]))
    # A > 0 with ρ below 1 - ε keeps the (lower) unclipped objective: PPO is pessimistic.
    assert dual.clipped.tolist() == [[True, False, False]]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo.clipped_policy_loss(log_probs, old, advantages, 0.2, dual_clip=1.0)


def test_ratio_one_gives_the_plain_policy_gradient() -> None:
    advantages = torch.tensor([[0.5, -2.0]])
    log_probs = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    result = ppo.clipped_policy_loss(log_probs, log_probs.detach(), advantages, clip_low=0.2)
    result.loss.sum().backward()
    assert log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, -advantages)  # ∇ -A·π/π_old = -A at ρ = 1


def test_kl_estimators_agree_at_zero_and_k3_is_second_order() -> None:
    same = torch.tensor([[-0.7]])
    assert float(ppo.kl_penalty(same, same, "k1")) == 0.0
    assert float(ppo.kl_penalty(same, same, "k3")) == 0.0
    x = 1e-3  # k3(x) = e^{-x} - 1 + x ≈ x²/2
    k3 = float(ppo.kl_penalty(torch.tensor([[x]]), torch.tensor([[0.0]]), "k3"))
    assert k3 == pytest.approx(x * x / 2, rel=1e-3)


def test_entropy_of_uniform_logits_is_log_vocab() -> None:
    entropy = ppo.entropy_from_logits(torch.zeros(2, 3, 50))
    torch.testing.assert_close(entropy, torch.full((2, 3), math.log(50)))


def test_importance_weights_cap_and_clipped_fraction() -> None:
    trainer = torch.log(torch.tensor([[3.0, 1.5, 0.5, 9.0]]))
    rollout = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    result = ppo.truncated_importance_weights(trainer, rollout, mask, cap=2.0)
    torch.testing.assert_close(result.weights, torch.tensor([[2.0, 1.5, 0.5, 0.0]]))
    assert float(result.clipped_fraction) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="cap"):
        ppo.truncated_importance_weights(trainer, rollout, mask, cap=0.5)
