"""Whether a run learned: a trend fitted to every step's reward, not two noisy windows.

A fully-async run's timing differs from run to run, so its rewards do too. Comparing
the mean of the first and last ten steps against a fixed margin failed one CI run in
several (+0.056 against a margin of 0.06, on a run that plainly learned). A
least-squares line through all the steps uses every step, and its t-statistic says
how sure the rise is, whatever the noise of that run.
"""

from __future__ import annotations

import numpy as np

MIN_T = 4.0  # a flat reward curve reaches t >= 4 about once in 10^4 runs


def fitted_rise(rewards: list[float]) -> tuple[float, float]:
    """The rise over the run of the least-squares line through the rewards, and the
    t-statistic of its slope."""
    steps = np.arange(len(rewards), dtype=float)
    (slope, _), cov = np.polyfit(steps, np.asarray(rewards), deg=1, cov=True)
    return float(slope * (len(rewards) - 1)), float(slope / np.sqrt(cov[0, 0]))


def assert_reward_rises(rewards: list[float], min_rise: float) -> None:
    rise, t = fitted_rise(rewards)
    summary = f"fitted rise {rise:+.3f} (t={t:.1f}) from {rewards[0]:.3f}; rewards {rewards}"
    assert rise >= min_rise and t >= MIN_T, summary
