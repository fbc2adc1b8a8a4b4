"""What each step tells an RL practitioner, per role: the first things to look at when a
run goes wrong. Each role's numbers keep their own names (the actor's grad norm is not
the critic's), and the metrics and the job's status are made from these types."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_trainer.algo.experience import Episode, Rollout


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

    episodes: tuple[Episode, ...]  # (B,) one per sample, at least one

    @classmethod
    def of(cls, rollouts: Sequence[Rollout]) -> EpisodeStats | None:
        episodes = tuple(r.episode for r in rollouts if r.episode is not None)
        return cls(episodes) if episodes else None

    @property
    def turns_mean(self) -> float:  # assistant turns per episode
        return sum(e.turns for e in self.episodes) / len(self.episodes)

    @property
    def tool_calls_mean(self) -> float:  # tool calls parsed per episode
        return sum(e.tool_calls for e in self.episodes) / len(self.episodes)

    @property
    def tool_call_rate(self) -> float:  # share of episodes with at least one tool call
        return sum(e.tool_calls > 0 for e in self.episodes) / len(self.episodes)

    @property
    def cuts(self) -> dict[str, int]:
        """Cut episodes by reason ("max_turns", "environment_timeout", ...): the kind of
        reason only, so that an environment's error messages are no metric labels."""
        reasons = Counter(e.cut.split(":")[0] for e in self.episodes if e.cut is not None)
        return dict(sorted(reasons.items()))

    @property
    def turn_reward_mean(self) -> float | None:
        """The environment's per-turn rewards summed per episode, averaged over the
        episodes; None where no episode had one."""
        if not any(e.turn_rewards for e in self.episodes):
            return None
        total = sum(r.reward for e in self.episodes for r in e.turn_rewards)
        return total / len(self.episodes)

    @property
    def restarts(self) -> int:  # sessions started again on another replica (a replica died)
        return sum(e.restarts for e in self.episodes)

    @property
    def cut_ratio(self) -> float:  # share cut by a limit or an error (multiTurn.cuts)
        return sum(self.cuts.values()) / len(self.episodes)
