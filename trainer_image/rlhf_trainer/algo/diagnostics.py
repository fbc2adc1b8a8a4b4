"""What each step tells an RL practitioner, per role: the first things to look at when a
run goes wrong. Each role's numbers keep their own names (the actor's grad norm is not
the critic's), and the metrics and the job's status are made from these types."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_trainer.algo.experience import Rollout


@dataclass(frozen=True)
class ActorStats:
    """The actor's update, averaged over its micro-batches and ranks."""

    policy_loss: float  # the clipped surrogate, mean over response tokens
    clip_fraction: float  # share of tokens where the clipped branch set the loss
    approx_kl: float  # k3 estimate of KL(π_old ‖ π): how far the update moved the policy
    entropy: float  # of π over response tokens
    importance_capped: float  # share of importance weights truncated (off-policy samples)
    grad_norm: float  # before clipping, mean over optimizer steps


@dataclass(frozen=True)
class CriticStats:
    """The critic's update, averaged over its micro-batches and ranks."""

    value_loss: float  # the clipped value loss, mean over response tokens
    value_clip_fraction: float  # share of tokens where the clipped value set the loss
    grad_norm: float  # before clipping, mean over optimizer steps
    # of the returns by the values the batch was scored with; NaN if the returns are flat
    explained_variance: float


@dataclass(frozen=True)
class ResponseStats:
    """The batch's responses."""

    length_mean: float  # tokens
    length_max: int
    truncated_ratio: float  # share cut at maxResponseLength (not ended by the model)

    @classmethod
    def of(cls, rollouts: Sequence[Rollout]) -> ResponseStats:
        lengths = [len(r.response_token_ids) for r in rollouts]
        return cls(
            length_mean=sum(lengths) / len(lengths),
            length_max=max(lengths),
            truncated_ratio=sum(not r.finished for r in rollouts) / len(rollouts),
        )
