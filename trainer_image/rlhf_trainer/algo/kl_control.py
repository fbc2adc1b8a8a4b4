"""The KL penalty's coefficient from step to step: fixed, or adapted towards a target
KL with the proportional controller of Ziegler et al. 2019 (as verl's
AdaptiveKLController): a KL above the target raises the coefficient, one below lowers it."""

from __future__ import annotations

from rlhf_trainer.api.algorithm import KLController

ERROR_CLIP = 0.2  # the proportional error's bound, as in the paper


def next_kl_coef(coef: float, kl: float, controller: KLController, samples: int) -> float:
    """The coefficient for the next step, after a step of `samples` samples whose mean KL
    (per response) was `kl`. Adaptive: coef x (1 + e x samples / horizon) with
    e = clip(kl / target - 1, ±0.2); a step larger than the horizon counts as the
    horizon, so one step moves the coefficient by 20% at most and it stays positive."""
    if controller.type == "fixed" or controller.target_kl is None:
        return coef
    error = min(max(kl / controller.target_kl - 1, -ERROR_CLIP), ERROR_CLIP)
    return coef * (1 + error * min(samples / controller.horizon, 1.0))
