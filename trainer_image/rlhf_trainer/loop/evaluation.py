"""Evaluation on held-out prompts (data.eval): before training, every evalEverySteps
steps, and at the end.

The rollout engines answer, at a step boundary, on the policy version they hold then,
beside whatever else they generate (fully async goes on streaming samples); the train
pools do nothing for it. Each engine answers in one call that holds its worker, so
the next weights load only after it: every response comes from one version. The
driver does not wait for the answers until it must: the next weight push (so that no
push waits in a collective on an engine that is busy answering), a checkpoint (so that
a resumed run never repeats an evaluation it reported), or the next evaluation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.eval_scores import eval_scores
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.progress import EvalProgress
from rlhf_trainer.api.sections import EvalGeneration
from rlhf_trainer.cluster.waits import answered, finished, join
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import rollout_input, split_list
from rlhf_trainer.telemetry.progress import eval_text

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 3600.0  # engines that take longer to answer are stuck: named, and fail


class EvaluationLost(RuntimeError):
    """Engines lost the answers of an evaluation that no engine can give again: those
    that serve hold other weights than the ones it was asked on."""


def eval_due(config: JobConfig, step: int) -> bool:
    """Whether the held-out prompts are scored after `step` steps (0: before training)."""
    if config.data.eval is None:
        return False
    every, total = config.trainer.eval_every_steps, config.trainer.total_steps
    return step in (0, total) or (every is not None and step % every == 0)


class Evaluator:
    """Starts evaluations on the rollout engines, and scores their answers."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.config = parts.config
        self.sampling = self.config.generation.eval
        # (P·k,) each held-out prompt k times, a prompt's answers next to each other
        k = self.sampling.samples_per_prompt
        self.asked = [p for p in parts.held_out for _ in range(k)]
        self.pending: PendingEvaluation | None = None
        self.last: EvalProgress | None = None  # the last one reported

    def owed(self, step: int) -> bool:
        """Due after `step` and not reported: at a run's start, before training, or the
        evaluation a checkpoint was taken without (the run was interrupted)."""
        reported = self.last is not None and self.last.step >= step
        return eval_due(self.config, step) and not reported

    def start(self, step: int) -> list[EvalProgress]:
        """Ask the engines for the held-out answers after `step` steps (once the last
        weights pushed are loaded); returns the evaluation this one waited for, if any."""
        done = self.finish(wait=True)
        rollout = self.parts.groups[Role.ROLLOUT]
        asked = [rollout_input(self.config, p) for p in self.asked]
        shards = split_list(asked, rollout.world_size)
        answers = rollout.run_each("evaluate", shards, step)
        self.parts.weights.wait_before_next_push(answers, ANSWER_TIMEOUT_S)
        version = self.parts.weights.served  # a push waits for the answers
        self.pending = PendingEvaluation(
            step, version, shards, list(rollout.ranks), [[a] for a in answers]
        )
        return done

    def forget(self, ranks: Sequence[int]) -> None:
        """Engines lost: the next push waits no more for the shards they had not
        answered (they never will); `rehome` asks them again."""
        pending = self.pending
        if pending is None:
            return
        lost = [i for i, rank in enumerate(pending.ranks)
                if rank in ranks and not answered(pending.answers[i])]  # fmt: skip
        self.parts.weights.forget_busy([call for i in lost for call in pending.answers[i]])
        pending.orphaned += [i for i in lost if i not in pending.orphaned]

    def rehome(self, ranks: Sequence[int], version: int) -> None:
        """The engines serve again, on policy `version`: the shards the lost ones had not
        answered go to those that serve, if they hold the version the evaluation was
        asked on (a push waits for an evaluation, so they do unless the loss was found
        in a push that brought new engines the weights since); else EvaluationLost."""
        pending = self.pending
        if pending is None or not pending.orphaned:
            return
        if version != pending.version:
            raise EvaluationLost(
                f"the evaluation after step {pending.step} lost the answers of rollout "
                f"rank(s) {list(ranks)}, and the engines now serve v{version}, not the "
                f"v{pending.version} it was asked on"
            )
        serving = self.parts.groups[Role.ROLLOUT]
        for index in pending.orphaned:
            engine = index % serving.world_size
            shards: list[list[Any]] = [[] for _ in serving.ranks]  # one answers it
            shards[engine] = pending.shards[index]
            pending.answers[index] = serving.run_each("evaluate", shards, pending.step)
            pending.ranks[index] = serving.ranks[engine]
            self.parts.weights.wait_before_next_push(pending.answers[index], ANSWER_TIMEOUT_S)
        pending.orphaned = []
        log.warning("the held-out prompts of rollout rank(s) %s are answered again by the "
                    "engines that serve", list(ranks))  # fmt: skip

    def finish(self, wait: bool) -> list[EvalProgress]:
        """The evaluation under way, scored, once its answers are in (at once with
        `wait`); [] while there is none, or it is not done and `wait` is false."""
        calls = [call for shard in self.pending.answers for call in shard] if self.pending else []
        if self.pending is None or not (wait or finished(calls)):
            return []
        step, self.pending = self.pending.step, None
        rollouts = [r for engine in join(calls, ANSWER_TIMEOUT_S) for r in engine]
        rewards = self.parts.scorer.score_alone(self.asked, rollouts)
        if unscored := int(torch.isnan(rewards).sum()):
            log.warning("held-out step %d: %d samples unscored (the reward service failed "
                        "them): counted as reward 0", step, unscored)  # fmt: skip
            rewards = rewards.nan_to_num(0.0)
        self.last = evaluation_of(step, rollouts, rewards, self.sampling)
        done = self.last
        log.info("held-out reward %s, policy v%d", eval_text(done), done.policy_version)
        return [self.last]


@dataclass
class PendingEvaluation:
    """An evaluation under way: the prompts of each shard (token ids, or multi-turn
    rows), the rank that answers it, and the calls whose answers, in order, are the
    shard's."""

    step: int
    version: int  # the policy the engines served as it was asked
    shards: list[list[Any]]
    ranks: list[int]
    answers: list[list[Any]]
    orphaned: list[int] = field(default_factory=list)  # shards of lost engines, to ask again


def evaluation_of(
    step: int, rollouts: list[Rollout], rewards: torch.Tensor, sampling: EvalGeneration
) -> EvalProgress:
    """The report of an evaluation: rollouts and rewards (P·k,), a prompt's k together."""
    versions = {v for r in rollouts for v in (r.policy_version, *(v for v, _ in r.version_spans))}
    if len(versions) != 1:  # each engine answers in one call, between two loads
        raise RuntimeError(f"the evaluation after step {step} spans versions {sorted(versions)}")
    k = sampling.samples_per_prompt
    lengths = torch.tensor([len(r.response_token_ids) for r in rollouts])
    scores = eval_scores(rewards.reshape(-1, k), lengths.reshape(-1, k), sampling.pass_reward)
    episodes = EpisodeStats.of(rollouts)
    return EvalProgress(
        step=step,
        policy_version=versions.pop(),
        prompts=len(rollouts) // k,
        samples_per_prompt=k,
        reward_mean=scores.reward_mean,
        pass_at_1=scores.pass_at_1,
        pass_at_k=scores.pass_at_k,
        response_length_mean=scores.response_length_mean,
        tool_call_rate=episodes.tool_call_rate if episodes else None,
        tool_calls_mean=episodes.tool_calls_mean if episodes else None,
        cut_ratio=episodes.cut_ratio if episodes else None,
    )
