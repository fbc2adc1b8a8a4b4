"""The RL algorithm's part of the spec: the advantage estimator, the policy-gradient
loss, the KL penalty and its controller, dynamic sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_trainer.api.rules import Rule, SpecModel

AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce++", "reinforce++-baseline"]
# The estimators that compare the samples of one prompt with each other: n >= 2.
GROUP_ESTIMATORS: tuple[AdvantageEstimator, ...] = ("grpo", "rloo", "reinforce++-baseline")


class DynamicSampling(SpecModel):
    """DAPO's dynamic sampling: groups whose rewards are all equal teach nothing (zero
    advantage); drop them and generate more until the batch is full."""

    max_attempts: int = Field(
        8,
        ge=1,
        le=1000,
        description=(
            "Generation rounds per step at most; the step fails, naming the counts, if the "
            "batch is still not full."
        ),
    )


class KLController(SpecModel):
    """How the KL penalty's coefficient moves from step to step: fixed at klCoef, or
    adapted so that the KL to the reference stays near a target (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description=(
            "fixed: klCoef throughout. adaptive: starts at klCoef and, after each step, is "
            "multiplied by 1 + clip(KL / targetKL - 1, -0.2, 0.2) x samples / horizon."
        ),
    )
    target_kl: float | None = Field(
        None,
        alias="targetKL",
        gt=0,
        le=1000,
        description=(
            "adaptive: the KL to hold, in the units of the reported KL (per response, "
            "tokens summed, averaged over the batch)."
        ),
    )
    horizon: int = Field(
        10000,
        ge=1,
        le=100_000_000,
        description=(
            "adaptive: samples over which a KL persistently off target moves the "
            "coefficient by about 20% (a step moves it by at most that)."
        ),
    )

    rules = (
        Rule(
            "targetKL",
            "is required when type is adaptive",
            # has(): the API server also checks the rules on the schema's defaults ({})
            "!has(self.type) || self.type != 'adaptive' || has(self.targetKL)",
            lambda c: c.type != "adaptive" or c.target_kl is not None,
        ),
    )


class AlgorithmConfig(SpecModel):
    """The RL algorithm: the advantage estimator and the policy-gradient loss."""

    advantage_estimator: AdvantageEstimator = Field(
        "gae",
        description=(
            "gae: PPO with a critic. Critic-free: grpo (group-normalised outcome), rloo "
            "(leave-one-out baseline), reinforce++ (globally normalised returns), "
            "reinforce++-baseline (group mean subtracted, then global normalisation)."
        ),
    )
    normalize_group_std: bool = Field(
        True,
        description="grpo: divide by the group's reward std (false = Dr. GRPO, mean only).",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "Discount factor of the per-token rewards (the outcome on the last token, KL "
            "penalties in reward). gae: GAE's discount. Critic-free estimators: each token's "
            "advantage is its discounted return-to-go, so below 1 earlier tokens get less of "
            "the outcome; 1 gives every token the same, as verl's outcome estimators do."
        ),
    )
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    clip_ratio: float = Field(0.2, gt=0, le=1, description="PPO policy clip range epsilon.")
    clip_ratio_low: float | None = Field(
        None, gt=0, le=1, description="Lower clip range (ratio >= 1 - low); unset = clipRatio."
    )
    clip_ratio_high: float | None = Field(
        None,
        gt=0,
        le=10,
        description="Upper clip range (ratio <= 1 + high; clip-higher); unset = clipRatio.",
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        le=100,
        description="Dual-clip constant c (> 1) bounding the loss of negative advantages.",
    )
    value_clip: float | None = Field(
        0.2, gt=0, le=100, description="Value-loss clip range; unset disables value clipping."
    )
    kl_coef: float = Field(
        0.05,
        ge=0,
        le=10,
        description="KL penalty coefficient (the first one with an adaptive klController); "
        "0 = no ref.",
    )
    kl_controller: KLController = Field(
        default_factory=KLController,
        description="Fixed or adaptive KL coefficient (adaptive needs klMode: reward).",
    )
    kl_mode: Literal["reward", "loss"] = Field(
        "reward", description="Apply KL as a per-token reward penalty, or as a loss term."
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k1", description="KL estimator: k1 = log-ratio, k3 = unbiased low-variance."
    )
    entropy_coef: float = Field(0.0, ge=0, le=1, description="Entropy bonus coefficient.")
    whiten_advantages: bool = Field(
        True,
        description=(
            "gae: normalise advantages per batch (the reinforce++ estimators always do; "
            "grpo and rloo are normalised per group)."
        ),
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How per-token losses are averaged into one number."
    )
    old_log_probs: Literal["recompute", "rollout"] = Field(
        "recompute",
        description=(
            "Where the PPO ratio's log π_old comes from. recompute: the actor scores the "
            "batch again before its update (a forward pass on the train pool). rollout: "
            "the log-probs the rollout engine sampled with, so the actor skips that pass; "
            "they match the actor's up to numerics (and, fully async, are the behaviour "
            "policy of each token)."
        ),
    )
    importance_cap: float = Field(
        2.0,
        ge=1,
        le=100,
        description=(
            "Cap of the truncated importance weight between the trainer's and the "
            "rollout's log-probs (off-policy correction of stale samples)."
        ),
    )
    dynamic_sampling: DynamicSampling | None = Field(
        None,
        description=(
            "Set to drop groups whose rewards are all equal and generate more "
            "(needs generation.samplesPerPrompt >= 2); unset = train on every group."
        ),
    )

    rules = (
        Rule(
            "klController.type",
            "adaptive needs klMode: reward and klCoef > 0 (the coefficient it starts from)",
            "!has(self.klController) || !has(self.klController.type) || "
            "self.klController.type != 'adaptive' || "
            "((!has(self.klMode) || self.klMode == 'reward') && "
            "(!has(self.klCoef) || self.klCoef > 0.0))",
            lambda a: (
                a.kl_controller.type != "adaptive" or (a.kl_mode == "reward" and a.kl_coef > 0)
            ),
            lambda a: f"klMode {a.kl_mode}, klCoef {a.kl_coef}",
        ),
    )

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    def clip_range(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high
