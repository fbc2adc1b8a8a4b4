"""The KL coefficient's controller against a naive transcription of the paper's (and
verl's AdaptiveKLController's) update, and in closed loop: on a policy whose KL falls as
the penalty rises, it settles near the target from either side."""

from __future__ import annotations

import pytest

from rlhf_trainer.algo.kl_control import next_kl_coef
from rlhf_trainer.api.algorithm import KLController

ADAPTIVE = KLController(type="adaptive", target_kl=2.0, horizon=64)


def naive_update(coef: float, kl: float, target: float, samples: int, horizon: int) -> float:
    error = kl / target - 1
    if error > 0.2:
        error = 0.2
    if error < -0.2:
        error = -0.2
    return coef * (1 + error * samples / horizon)


@pytest.mark.parametrize("kl", [0.0, 0.5, 1.9, 2.0, 2.1, 3.0, 40.0])
@pytest.mark.parametrize("samples", [1, 16, 64])
def test_the_adaptive_update_matches_the_naive_reference(kl: float, samples: int) -> None:
    assert next_kl_coef(0.05, kl, ADAPTIVE, samples) == pytest.approx(
        naive_update(0.05, kl, 2.0, samples, 64), rel=1e-12
    )


def test_a_fixed_controller_never_moves_and_an_adaptive_step_moves_at_most_a_fifth() -> None:
    assert next_kl_coef(0.05, 40.0, KLController(), 32) == 0.05
    # A step of more samples than the horizon counts as the horizon: the coefficient
    # moves by 20% at most and stays positive.
    assert next_kl_coef(0.05, 40.0, ADAPTIVE, 10_000) == pytest.approx(0.06)
    assert next_kl_coef(0.05, 0.0, ADAPTIVE, 10_000) == pytest.approx(0.04)


@pytest.mark.parametrize("start", [0.001, 1.0])
def test_in_closed_loop_the_kl_settles_near_its_target(start: float) -> None:
    def kl_of(coef: float) -> float:  # a policy that drifts less as the penalty grows
        return 0.1 / coef

    coef = start
    for _ in range(400):
        coef = next_kl_coef(coef, kl_of(coef), ADAPTIVE, samples=32)
    assert kl_of(coef) == pytest.approx(ADAPTIVE.target_kl, rel=0.05)
