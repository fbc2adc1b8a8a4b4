"""An episode as it goes (EpisodeProgress): its trajectory, the versions of its turns,
its phases and per-turn rewards, and the Rollout the trainer takes once it ends, with
its cut's policy (multiTurn.cuts) applied. The environment calls live in episodes.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rlhf_trainer.algo.experience import Episode, EpisodePhase, PhaseKind, Rollout, TurnReward
from rlhf_trainer.api.cuts import CutPolicies
from rlhf_trainer.rollout.chat_template import ChatRenderer
from rlhf_trainer.rollout.trajectory import Trajectory


class EpisodeProgress:
    """An episode as it goes: its trajectory, its session, the version spans of its
    turns (response-relative), and its score once the environment gave it."""

    def __init__(self, trajectory: Trajectory, version: int, restarts: int = 0) -> None:
        self.trajectory = trajectory
        self.version = version
        self.restarts = restarts  # sessions started again on another replica before it
        self.session: str | None = None
        self.spans: list[tuple[int, int]] = []  # (version, first response token index)
        self.score: float | None = None
        self.phases: list[EpisodePhase] = []
        self.turn_rewards: list[TurnReward] = []

    @contextmanager
    def timed(self, kind: PhaseKind, tool_calls: int = 0) -> Iterator[None]:
        """Record the block as a phase of the current turn (also when it raises: a turn
        cut by its deadline shows for as long as it ran)."""
        turn = self.trajectory.turns + (kind == "turn")
        start = time.time()
        try:
            yield
        finally:
            self.phases.append(EpisodePhase(kind, turn, start, time.time(), tool_calls))

    @classmethod
    def opening(cls, renderer: ChatRenderer, version: int, restarts: int = 0) -> EpisodeProgress:
        """Until the environment opens it: one token, so a cut episode still packs."""
        return cls(Trajectory(prompt_ids=[renderer.end_of_turn_id]), version, restarts)

    def add_turn(self, turn: Rollout, tool_calls: int) -> None:
        offset = len(self.trajectory.token_ids) - len(self.trajectory.prompt_ids)
        spans = turn.version_spans or ((turn.policy_version, 0),)
        self.spans += [(version, offset + start) for version, start in spans]
        self.trajectory.add_sampled(
            turn.response_token_ids, turn.response_log_probs, turn.policy_version, tool_calls
        )

    def add_turn_reward(self, reward: float | None) -> None:
        """The reward the environment gave the last turn, if it gave one: at the turn's
        last sampled token (the environment answered before anything followed it)."""
        if reward is not None:
            last = len(self.trajectory.token_ids) - len(self.trajectory.prompt_ids) - 1
            self.turn_rewards.append(TurnReward(self.trajectory.turns - 1, last, reward))

    def rollout(self, cuts: CutPolicies, environment: str = "") -> Rollout:
        """The episode as the trainer takes it (see Rollout and Episode). One that ended
        without a score was cut: `cuts` says whether its sampled turns are trained on,
        and with what score; else its loss mask is all 0 (Trajectory.loss_mask)."""
        trajectory, prompt = self.trajectory, len(self.trajectory.prompt_ids)
        versions = [version for version, _ in self.spans] or [self.version]
        policy = None if trajectory.cut is None else cuts.of(trajectory.cut)
        trained = policy is not None and policy.trains and trajectory.turns > 0
        mask = trajectory.sampled_mask if trained else trajectory.loss_mask
        if policy is None:
            score = self.score if self.score is not None else 0.0
        else:
            score = policy.reward if trained else 0.0
        return Rollout(
            prompt_token_ids=trajectory.prompt_ids,
            response_token_ids=trajectory.token_ids[prompt:],
            response_log_probs=trajectory.log_probs[prompt:],
            finished=trajectory.cut is None,
            policy_version=min(versions),
            version_spans=tuple(merged_spans(self.spans)),
            loss_mask=tuple(mask[prompt:]),
            episode=Episode(
                score=score,
                turns=trajectory.turns,
                tool_calls=trajectory.tool_calls,
                version_span=max(versions) - min(versions),
                cut=trajectory.cut,
                phases=tuple(self.phases),
                restarts=self.restarts,
                turn_rewards=tuple(self.turn_rewards),
                environment=environment,
            ),
        )


def merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans with a repeated version joined to the one before (turns of one policy)."""
    merged: list[tuple[int, int]] = []
    for version, start in spans:
        if not merged or merged[-1][0] != version:
            merged.append((version, start))
    return merged
