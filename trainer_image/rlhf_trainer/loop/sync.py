"""The PPO loop: one step, top to bottom, for every placement.

    generate → (actor log-probs ∥ ref log-probs ∥ values ∥ reward) → advantages
             → (update actor ∥ update critic) → sync weights → log

The placement plan (api/plan.py) is the schedule: which phases make up each stage, and
in what order each pool's lane runs them. Each role's calls return futures. The calls of
one stage are all issued before any is joined, so roles on different pools run at the
same time (split placement) while roles sharing a pool queue up on its GPUs (colocated):
only the placement differs. Every call carries its phase's name to the timeline.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from rlhf_trainer.algo.diagnostics import ActorStats, CriticStats, EpisodeStats, ResponseStats
from rlhf_trainer.algo.estimators import compute_advantages, scored_mean, without_unscored
from rlhf_trainer.algo.experience import Experience, Rollout, Sequences, mean_kl, pack_rollouts
from rlhf_trainer.algo.kl_control import next_kl_coef
from rlhf_trainer.algo.ppo import explained_variance
from rlhf_trainer.algo.row_samples import RowSamples
from rlhf_trainer.algo.turn_rewards import TurnRewardTable, turn_token_rewards
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import DRIVER, Phase
from rlhf_trainer.api.progress import EvalProgress
from rlhf_trainer.cluster.waits import gather, join, results_as_they_come
from rlhf_trainer.data.prompts import Prompt
from rlhf_trainer.loop.cut_steps import CutSteps
from rlhf_trainer.loop.dynamic_sampling import keep_informative_groups
from rlhf_trainer.loop.rewards import REWARD_METHOD
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.rollout.worker import BatchShard
from rlhf_trainer.telemetry.metrics import union_seconds

if TYPE_CHECKING:
    from rlhf_trainer.cluster.groups import ObjectRef

# The worker method that runs each phase on the workers of its role (plan.phase_role).
# Which phases run together, and in what order on a pool, is the placement plan's business.
PHASE_METHOD: dict[Phase, str] = {
    Phase.GENERATE: "generate",
    Phase.ACTOR_LOG_PROB: "log_probs",
    Phase.REF_LOG_PROB: "ref_log_probs",
    Phase.VALUES: "values",
    Phase.REWARD: REWARD_METHOD,
    Phase.UPDATE_ACTOR: "update",
    Phase.UPDATE_CRITIC: "update",
}

Calls = dict[Phase, list["ObjectRef[Any]"]]  # one future per rank, for each phase issued


@dataclass(frozen=True)
class StepResult:
    step: int
    seconds: float  # wall time of the step
    reward_mean: float  # over the samples with a reward (NaN: none had one)
    kl: float
    response_tokens: int
    # max |log π_actor - log π_rollout| over the batch's tokens: the engine samples with
    # the weights the actor has (before its update), up to numerics (0 when the rollout's
    # log-probs are log π_old: oldLogProbs rollout)
    rollout_log_prob_diff: float
    actor: ActorStats
    critic: CriticStats | None  # None for the critic-free estimators
    responses: ResponseStats
    phase_seconds: dict[str, float] = field(default_factory=dict)  # busy time per phase
    # per sample: policy versions between the one that started generating it and the
    # one trained on it (fully async; 0 in synchronous PPO)
    staleness: list[int] = field(default_factory=list)
    sample_uids: list[int] = field(default_factory=list)  # fully async: which samples
    dropped_groups: int = 0  # dynamic sampling: groups with all rewards equal, regenerated
    kl_coef: float = 0.0  # the KL penalty's coefficient this step used (klController)
    # held-out evaluations finished since the last step (one may have started earlier)
    evaluations: tuple[EvalProgress, ...] = ()
    rollout_engines: int = 0  # fully async: the engines serving as the step ended
    episodes: EpisodeStats | None = None  # multi-turn rollouts only
    unscored: int = 0  # samples without a reward (the reward service failed them): masked
    samples: int = 0  # trained on: one a data row, an agent episode's several (row_samples)


@dataclass(frozen=True)
class Batch:
    """What a step trains on: the rows of whole groups, a group's rows together. A row
    is one sample, or an agent episode's several (Rollout.others: algo.row_samples)."""

    prompts: list[Prompt]  # (B·n,) each row's prompt
    rollouts: list[Rollout]  # (B·n,)
    # (B·n,) each sample's key: a reward service that scores samples as they finish
    # (the trainer's `scores_ahead`) keeps its reward by it
    keys: list[int]
    scores: torch.Tensor | None = None  # (B·n,) the rows', when already scored (dynamic sampling)
    dropped_groups: int = 0


class PPOTrainer:
    """Runs PPO steps over the run's parts (loop.setup): it builds and closes none."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.config = parts.config
        self.plan = parts.plan
        self.groups = parts.groups
        self.prompts = parts.prompts
        self.timeline = parts.timeline
        self.scorer = parts.scorer
        self.weight_sync = parts.weights
        self.engines = parts.engines
        self.sample_keys = itertools.count()  # the samples' keys (Batch.keys)
        self.group_size = parts.config.generation.samples_per_prompt
        self.kl_coef = parts.config.algorithm.kl_coef  # moved by an adaptive klController
        multi_turn = parts.config.multi_turn
        self.cut_steps = CutSteps.of(multi_turn) if multi_turn is not None else None

    @property
    def policy_version(self) -> int:
        """The actor's weights: bumped by every update (the weight sync's to push)."""
        return self.weight_sync.actor_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.weight_sync.actor_version = version

    def step(self, step: int) -> StepResult:
        """One synchronous PPO step: generate, train on it, hand the weights over."""
        started = time.time()
        batch = self.sample(step)
        result = self.train_on(step, batch)
        self.policy_version += 1
        self.sync_weights()
        return replace(
            result, seconds=time.time() - started, phase_seconds=self.record_spans(since=started)
        )

    def sample(self, step: int) -> Batch:
        """batchSize prompts, samplesPerPrompt responses each."""
        if self.config.algorithm.dynamic_sampling is not None:
            return self.sample_dynamically(step)
        return self.generate(self.prompts.next_batch(self.config.trainer.batch_size), step)

    def sample_dynamically(self, step: int) -> Batch:
        """Like `sample`, but groups whose rewards are all equal are dropped and more
        prompts generated, round after round, until the batch is full (DAPO)."""

        def draw(groups: int, attempt: int) -> list[tuple[Prompt, Rollout, int]]:
            drawn = self.generate(self.prompts.next_batch(groups), step, attempt)
            return list(zip(drawn.prompts, drawn.rollouts, drawn.keys, strict=True))

        def score(drawn: Sequence[tuple[Prompt, Rollout, int]]) -> torch.Tensor:
            prompts, rollouts, keys = (list(column) for column in zip(*drawn, strict=True))
            return self.scorer.score_alone(prompts, rollouts, keys)

        kept = keep_informative_groups(step, self.config, draw, score)
        prompts, rollouts, keys = (list(column) for column in zip(*kept.items, strict=True))
        return Batch(prompts, rollouts, keys, kept.scores, kept.dropped)

    def grouped(self, prompts: Sequence[Prompt]) -> list[Prompt]:
        """Each prompt once per sample of its group."""
        return [p for p in prompts for _ in range(self.group_size)]

    def train_on(self, step: int, sampled: Batch) -> StepResult:
        """Score the batch, compute advantages and update the actor and the critic
        (the caller bumps the policy version). Without timings. Raises TooManyCuts
        first when too many steps in a row cut too many episodes (multiTurn.maxCutRatio)."""
        episodes = EpisodeStats.of(sampled.rollouts)  # one a row: an agent episode once
        if self.cut_steps is not None and episodes is not None:
            self.cut_steps.count(step, episodes)
        # (S,) an agent episode's several, padded to whole mini-batches
        samples = RowSamples.of(sampled.rollouts, self.config.trainer.mini_batch_size)
        batch = pack_rollouts(samples.batch, self.parts.tokens.pad_id)

        # Score: every pool at once; the rule-based reward runs here meanwhile. A row is
        # scored once (an agent episode by its own sample), its samples share the reward.
        scores = sampled.scores
        scoring = self.run_stage("score", batch, skip=(Phase.REWARD,) if scores is not None else ())
        if scores is None:
            model = scoring.get(Phase.REWARD)  # a reward model's calls, on the S samples
            scores = self.scorer.score(
                sampled.prompts, sampled.rollouts, model, sampled.keys, samples.own
            )
        unscored = self.scorer.unscored.count(step, scores)
        reward_mean = scored_mean(scores)
        scores, unscored_masked = without_unscored(samples.scores(scores), batch.response_mask)
        batch = replace(batch, response_mask=unscored_masked)
        recomputed = gather_if(scoring, Phase.ACTOR_LOG_PROB)  # unless oldLogProbs: rollout
        old_log_probs = batch.rollout_log_probs if recomputed is None else recomputed
        values = gather_if(scoring, Phase.VALUES)
        ref_log_probs = gather_if(scoring, Phase.REF_LOG_PROB)
        mask = batch.response_mask
        advantages = compute_advantages(
            scores,
            old_log_probs,
            ref_log_probs,
            values,
            mask,
            self.config.algorithm,
            self.group_size,
            self.kl_coef,
            self.turn_rewards(samples.batch, mask),
            groups=samples.groups(self.group_size),
        )
        experience = Experience.of(
            batch,
            old_log_probs=old_log_probs,
            advantages=advantages.advantages,
            values=values,
            returns=advantages.returns,
            ref_log_probs=ref_log_probs,
        )

        # Update: actor and critic at once.
        updates = self.run_stage("update", experience, step)
        kl, kl_coef = mean_kl(advantages.kl, mask), self.kl_coef
        self.kl_coef = next_kl_coef(kl_coef, kl, self.config.algorithm.kl_controller, len(mask))
        return StepResult(
            step=step,
            seconds=0.0,
            reward_mean=reward_mean,
            kl=kl,
            kl_coef=kl_coef,
            response_tokens=int(mask.sum()),
            rollout_log_prob_diff=max_abs_diff(old_log_probs, batch.rollout_log_probs, mask),
            actor=ActorStats(**mean_stats(join(updates[Phase.UPDATE_ACTOR]))),
            critic=critic_stats(updates, experience),
            responses=ResponseStats.of(samples.rollouts),
            episodes=episodes,
            dropped_groups=sampled.dropped_groups,
            unscored=unscored,
            samples=len(samples),
        )

    def turn_rewards(self, rollouts: Sequence[Rollout], mask: torch.Tensor) -> torch.Tensor | None:
        """(B, T) the episodes' per-turn rewards (generation.multiTurn); None without."""
        multi_turn = self.config.multi_turn
        if multi_turn is None:
            return None
        table = TurnRewardTable.of(rollouts)
        return turn_token_rewards(table, mask, multi_turn.turn_reward_discount)

    def generate(self, prompts: Sequence[Prompt], step: int, attempt: int = 0) -> Batch:
        """samplesPerPrompt responses to each prompt, a group's next to each other: with
        generation.multiTurn, an episode per sample, which the prompt's row starts. Each
        sample comes from its engine as it finishes, and a reward service is given it
        then (`scores_ahead`). An engine lost meanwhile is replaced, and the batch
        generated again: the same samples (`membership`)."""
        method = "run_episodes" if runs_episodes(self.config) else PHASE_METHOD[Phase.GENERATE]
        grouped = self.grouped(prompts)
        inputs = [rollout_input(self.config, p) for p in grouped]

        def on_the_engines() -> Batch:
            rollout = self.groups[Role.ROLLOUT]
            parts = split_list(inputs, rollout.world_size)
            starts = list(itertools.accumulate(map(len, parts), initial=0))
            shards = [BatchShard(index, part) for index, part in enumerate(parts)]
            streams = rollout.stream_each(method, shards, step, attempt, phase=Phase.GENERATE)
            rollouts: dict[int, Rollout] = {}  # by place in the batch
            keys = [next(self.sample_keys) for _ in inputs]
            for shard, (place, finished) in results_as_they_come(streams):
                at = starts[shard] + place
                rollouts[at] = finished
                self.scorer.offer([keys[at]], [grouped[at]], [finished])
            return Batch(grouped, [rollouts[at] for at in range(len(inputs))], keys)

        return self.engines.surviving(on_the_engines, f"the generation of step {step}")

    def run_stage(
        self, name: str, batch: Sequences, *args: Any, skip: Sequence[Phase] = ()
    ) -> Calls:
        """Issue the plan's stage `name` on `batch` (and `args`): each lane's phases one
        after another on its pool (colocated roles take turns on its GPUs), the lanes of
        different pools at once. A phase on the driver (a rule-based reward) is left to
        the caller, and so are the phases in `skip`."""
        calls: Calls = {}
        for lane in self.plan.stage(name).lanes:
            if lane.pool == DRIVER:
                continue
            after = None
            for phase in (p for p in lane.phases if p not in skip):
                group = self.groups[self.plan.phase_role[phase]]
                method = PHASE_METHOD[phase]
                after = calls[phase] = group.run_sharded(
                    method, batch, *args, after=after, phase=phase
                )
        return calls

    def sync_weights(self) -> None:
        """Hand the actor's weights to every rollout engine, and wait until they have
        them (those that replace engines lost in it too)."""
        version = self.policy_version
        self.engines.surviving(
            lambda: self.weight_sync.push(version), f"the weight push of v{version}", Exception
        )

    def record_spans(self, since: float) -> dict[str, float]:
        """Put every rank's timed calls on the timeline; returns each phase's busy
        seconds since `since` (the union of its spans over ranks, clipped to it)."""
        for role, ranks in self.groups.drain_calls().items():
            pool = self.groups[role].pool
            for rank_calls in ranks:
                for phase, start, end in rank_calls:  # named by the phase, else the method
                    self.timeline.record(pool, role, phase, start, end)
        by_phase: dict[str, list[tuple[float, float]]] = {}
        for span in self.timeline.spans():
            if span.end > since:  # clipped: async generation runs across steps
                by_phase.setdefault(span.phase, []).append((max(span.start, since), span.end))
        return {phase: union_seconds(intervals) for phase, intervals in by_phase.items()}


def critic_stats(updates: Calls, experience: Experience) -> CriticStats | None:
    """The critic's update, and how well the values it scored with explained the returns."""
    if experience.values is None or experience.returns is None:
        return None
    return CriticStats(
        **mean_stats(join(updates[Phase.UPDATE_CRITIC])),
        explained_variance=explained_variance(
            experience.values, experience.returns, experience.response_mask
        ),
    )


def rollout_input(config: JobConfig, prompt: Prompt) -> list[int] | dict[str, Any]:
    """What a rollout engine is given for a prompt: its token ids, or with
    generation.multiTurn (generation.agent) the row an episode starts from."""
    return prompt.fields if runs_episodes(config) else prompt.token_ids


def runs_episodes(config: JobConfig) -> bool:
    """Rollouts are episodes: of an environment (multiTurn) or of an agent (agent)."""
    return config.multi_turn is not None or config.generation.agent is not None


def gather_if(calls: Calls, phase: Phase) -> torch.Tensor | None:
    """The phase's per-rank results joined, or None when its role does not run."""
    return gather(calls[phase]) if phase in calls else None


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max()) if mask.any() else 0.0


def mean_stats(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    return {name: sum(s[name] for s in per_rank) / len(per_rank) for name in per_rank[0]}


def split_list(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """`parts` contiguous slices in order, sizes differing by at most one."""
    size, extra = divmod(len(items), parts)
    slices, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        slices.append(list(items[start:end]))
        start = end
    return slices
