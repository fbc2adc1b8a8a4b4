"""The learning check the trainer tests share: it passes a noisy rising curve and
fails a flat one and a falling one."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.learning import assert_reward_rises, fitted_rise


def noisy(start: float, rise: float, steps: int = 60, noise: float = 0.03) -> list[float]:
    rng = np.random.default_rng(0)
    line = np.linspace(start, start + rise, steps)
    return [float(x) for x in line + rng.normal(0, noise, steps)]


def test_the_fitted_rise_of_a_straight_line_is_exact() -> None:
    rise, t = fitted_rise([0.1 + 0.01 * i + (0.001 if i % 2 else -0.001) for i in range(11)])
    assert rise == pytest.approx(0.1, abs=1e-3)
    assert t > 50


def test_a_noisy_rising_curve_passes() -> None:
    assert_reward_rises(noisy(0.15, 0.06), min_rise=0.03)


@pytest.mark.parametrize("rise", [0.0, -0.06])
def test_a_flat_or_falling_curve_fails(rise: float) -> None:
    with pytest.raises(AssertionError, match="fitted rise"):
        assert_reward_rises(noisy(0.15, rise), min_rise=0.03)
