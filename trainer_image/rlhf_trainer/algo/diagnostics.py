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


@dataclass(frozen=True)
class EpisodeStats:
    """The batch's multi-turn episodes (generation.multiTurn)."""

    turns_mean: float  # assistant turns per episode
    tool_calls_mean: float  # tool calls parsed per episode
    cut_ratio: float  # share of episodes cut by a limit or an error: masked, not trained on
    cuts: dict[str, int]  # cut episodes by reason ("max_turns", "environment_error", ...)
    version_span_max: int  # policy versions between an episode's oldest and newest turn

    @classmethod
    def of(cls, rollouts: Sequence[Rollout]) -> EpisodeStats | None:
        episodes = [r.episode for r in rollouts if r.episode is not None]
        if not episodes:
            return None
        cuts: dict[str, int] = {}
        for episode in episodes:
            if episode.cut is not None:
                reason = episode.cut.split(":")[0]  # an error's message is no label
                cuts[reason] = cuts.get(reason, 0) + 1
        return cls(
            turns_mean=sum(e.turns for e in episodes) / len(episodes),
            tool_calls_mean=sum(e.tool_calls for e in episodes) / len(episodes),
            cut_ratio=sum(cuts.values()) / len(episodes),
            cuts=cuts,
            version_span_max=max(e.version_span for e in episodes),
        )
