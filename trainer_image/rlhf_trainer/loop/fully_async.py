"""Fully asynchronous PPO: the rollout pool generates all the time, the trainer pools
train on whatever has finished.

    rollouter (rollout pool) ──sample by sample──▶ queue ──B at a time──▶ train_on
          ▲                                                                │
          └──── every K steps: hand over the weights, admit ◀─────────────┘

Admission keeps generation at most `stalenessThreshold` ahead: after a weight sync the
prompts still outstanding (in flight or queued, all of them now stale) count towards
the limit B·K·(1+s), and only the rest of the limit is admitted. With s = 0 exactly
the next K batches are admitted after each sync, so every sample is trained by the
version that generated it (K = 1) or within K-1 versions of it.

With samplesPerPrompt n > 1 admission counts prompts, each admitted as a group of n
samples; the queue hands out whole groups, and a group is as stale as its oldest sample.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from rlhf_env.rewards import ScoredSample
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.cluster.groups import WorkerGroup, join_watching
from rlhf_trainer.cluster.hangs import RankDied, RanksLost
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.data.prompts import Prompt, PromptStream
from rlhf_trainer.loop.dynamic_sampling import keep_informative_groups
from rlhf_trainer.loop.elastic_rollout import ElasticRollout
from rlhf_trainer.loop.scores_ahead import QueueArrivals
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import Batch, PPOTrainer, StepResult, rollout_input
from rlhf_trainer.rollout.queue import AdmissionControl, Admitted, Sample, group_staleness

log = logging.getLogger(__name__)

QUEUE_TIMEOUT_S = 3600.0  # a batch that takes longer to generate than this is a fault

T = TypeVar("T")


@dataclass
class AsyncState:
    """What a checkpoint of the async mode adds: the samples not trained yet."""

    admission: dict[str, int]  # AdmissionControl.state(), in prompts (groups)
    queued: list[Sample]
    in_flight: list[Admitted]

    def to_json(self) -> dict[str, Any]:
        return {
            "admission": self.admission,
            "queued": [s.to_json() for s in self.queued],
            "in_flight": [list(admitted) for admitted in self.in_flight],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AsyncState:
        return cls(
            admission={key: int(value) for key, value in data["admission"].items()},
            queued=[Sample.from_json(s) for s in data["queued"]],
            in_flight=[
                (
                    int(uid),
                    int(index),
                    given if isinstance(given, dict) else [int(t) for t in given],
                )
                for uid, index, given in data["in_flight"]
            ],
        )


class AsyncPPOTrainer:
    """Drives the rollouter and trains the PPO core on its samples."""

    def __init__(self, core: PPOTrainer, parts: RunParts) -> None:
        self.core = core
        self.config: JobConfig = parts.config
        assert self.config.async_ is not None
        self.sync_every = self.config.async_.trigger_parameter_sync_step
        self.admission = AdmissionControl(
            self.config.trainer.batch_size, self.sync_every, self.config.async_.staleness_threshold
        )
        self.queue = parts.queue
        self.metrics = parts.metrics
        self.scorer = parts.scorer
        self.group_size = core.group_size
        # Groups taken from the queue (to train, or dropped): admitted ones not taken
        # are outstanding, queued or in flight, which no engine needs asking.
        self.groups_taken = 0
        self.elastic = ElasticRollout(core, parts)

    @property
    def rollout(self) -> WorkerGroup:
        """The rollout engines that serve (those lost are gone from it)."""
        return self.elastic.group

    @property
    def prompts(self) -> PromptStream:
        return self.core.prompts

    def start(self, resumed: AsyncState | None = None) -> None:
        """Admit the first prompts (or what a checkpoint had outstanding)."""
        if resumed is not None:
            self.push_weights()  # the engines start from the initial weights
            self.admission.restore(resumed.admission)
            join([self.queue.restore.remote(resumed.queued)])
            self.elastic.give(resumed.in_flight)
            outstanding = (len(resumed.queued) + len(resumed.in_flight)) // self.group_size
            self.groups_taken = self.admission.admitted_total - outstanding
            self.admission.on_weight_sync(outstanding)
        # A reward service scores the samples as they reach the queue.
        self.scorer.feed_from(QueueArrivals(self.queue, self.scored_samples))
        self.admit()

    def step(self, step: int) -> StepResult:
        started = time.time()
        # Read as the step starts, set as it ends: the answer is in by then (no wait).
        depth = self.queue.depth.remote()
        samples, scores, dropped = self.take_batch(step)
        version = self.core.policy_version
        lags = group_staleness(samples, version, self.group_size)
        for lag in lags:
            self.metrics.sample_staleness.observe(lag)
        rollouts, uids = [s.rollout for s in samples], [s.uid for s in samples]
        batch = Batch(self.prompts_of(samples), rollouts, uids, scores, dropped)
        result = self.core.train_on(step, batch)
        self.core.policy_version += 1
        if step % self.sync_every == 0:
            self.sync_weights()
        self.metrics.queue_depth.set(join([depth])[0])
        return replace(
            result,
            seconds=time.time() - started,
            phase_seconds=self.core.record_spans(since=started),
            staleness=lags,
            sample_uids=[s.uid for s in samples],
            rollout_engines=self.rollout.world_size,
        )

    def take_batch(self, step: int) -> tuple[list[Sample], torch.Tensor | None, int]:
        """The step's samples (whole groups), their rewards when already scored, and
        the groups dropped. With dynamic sampling, groups whose rewards are all equal
        are dropped and as many new prompts admitted in their place (they leave the
        admission's count as trained ones do, so the staleness bound holds)."""
        if self.config.algorithm.dynamic_sampling is None:
            return self.take_groups(self.config.trainer.batch_size), None, 0

        def draw(groups: int, attempt: int) -> list[Sample]:
            if attempt > 0:
                self.admission.on_dropped(groups)
                self.admit()
            return self.take_groups(groups)

        kept = keep_informative_groups(step, self.config, draw, self.score_samples)
        return kept.items, kept.scores, kept.dropped

    def score_samples(self, samples: Sequence[Sample]) -> torch.Tensor:
        """(B,) the samples' rewards, scored now (or as they arrived)."""
        prompts, rollouts = self.prompts_of(samples), [s.rollout for s in samples]
        return self.scorer.score_alone(prompts, rollouts, [s.uid for s in samples])

    def scored_samples(self, samples: Sequence[Sample]) -> list[ScoredSample]:
        """What the reward service is sent for each sample."""
        return self.scorer.samples(self.prompts_of(samples), [s.rollout for s in samples])

    def take_groups(self, groups: int) -> list[Sample]:
        """The next `groups` whole groups from the queue, waiting for them, in uid order
        (a group's uids are consecutive): the order they arrived in is the engines'
        timing, and the update must not depend on it (at staleness 0 a run is then
        reproducible, and a resumed one replays by value)."""
        taken = self.queue.get_batch.remote(groups * self.group_size, QUEUE_TIMEOUT_S)
        # An engine that dies fills the queue no more: go on without it at once.
        samples = self.surviving(lambda: join_watching(taken, self.rollout), "the batch's wait")
        if samples is None:
            raise TimeoutError(f"no batch of samples within {QUEUE_TIMEOUT_S:g} s")
        self.groups_taken += groups
        self.elastic.ledger.taken(s.uid for s in samples)
        return sorted(samples, key=lambda sample: sample.uid)

    def surviving(
        self, calls: Callable[[], T], what: str, lost_in: type[Exception] = RankDied
    ) -> T:
        """`calls` to the engines, made again after each loss of engines they meet: an
        engine whose process died (RankDied; with `lost_in`, any failure while an
        engine is found dead) is dropped and what it owed given to the others
        (`lose_engines`). A failure with every engine alive is raised, and so is the
        loss of the last one. `what` names the calls in the log."""
        while True:
            try:
                return calls()
            except lost_in as error:
                # Engines found lost already (silent for a minute, say) need no new look.
                lost = error if isinstance(error, RanksLost) else self.elastic.dead()
                if lost is None or lost.role != Role.ROLLOUT:
                    raise
                self.lose_engines(lost)
            log.warning("%s failed on the engine(s) lost; again on those that serve", what)

    def lose_engines(self, lost: RanksLost) -> None:
        """Go on with the engines that live, and admit what the lost ones owed to them
        (`ElasticRollout.lose`, which also takes any that die meanwhile); raises
        RanksLost when no engine is left."""
        self.elastic.give(self.elastic.lose(lost))

    def change_engines(self) -> None:
        """Between the trainer's calls to the engines: drop those that died since, and
        take in those started on GPUs that joined the pool once they are up."""
        if (lost := self.elastic.dead()) is not None:
            self.lose_engines(lost)
        if (joining := self.elastic.ready_to_join()) is not None:
            self.wait_for_rollout()  # its admissions are one per engine
            self.elastic.join(joining)

    def prompts_of(self, samples: Sequence[Sample]) -> list[Prompt]:
        return [self.prompts.prompts[s.prompt_index] for s in samples]

    def admit(self) -> None:
        """Admit prompts up to the staleness limit, n samples each, spread over the
        engines. Prompt number g's samples get the uids g·n … g·n + n - 1."""
        first = self.admission.admitted_total  # prompts are numbered in admission order
        count = 0
        while self.admission.try_admit():
            count += 1
        n = self.group_size
        self.elastic.give(
            [
                ((first + i) * n + j, p, rollout_input(self.config, self.prompts.prompts[p]))
                for i, p in enumerate(self.prompts.next_indices(count))
                for j in range(n)
            ]
        )

    def wait_for_rollout(self) -> None:
        """Wait for the admissions since the last wait; an engine that died in one is
        lost, and what it owed admitted again."""
        timeout_s = self.core.weight_sync.timeout_s
        self.surviving(lambda: self.elastic.wait_for_admissions(timeout_s), "the admissions")

    def sync_weights(self) -> None:
        """Hand the new policy to the engines; in-flight requests continue on it
        (partial rollout), or finish on the old one first without partial rollout.
        Then admit what the staleness limit allows."""
        started = time.time()
        self.change_engines()
        assert self.config.async_ is not None
        if not self.config.async_.partial_rollout:
            self.wait_for_rollout()
            self.surviving(lambda: join(self.rollout.run("drain")), "the drain")
        self.push_weights()
        self.metrics.weight_sync_seconds.observe(time.time() - started)
        self.admission.on_weight_sync(self.admission.admitted_total - self.groups_taken)
        self.admit()  # once the engines have the new weights (after their loads)

    def push_weights(self) -> None:
        """Hand the actor's weights to the engines. Each pauses only while it loads
        them (its requests in flight keep their tokens), then goes on with them. An
        engine lost in the push fails it (whatever the error then: the transfer's own,
        or a peer's); the others then take it again whole."""

        def push() -> None:
            self.wait_for_rollout()  # with the admissions of what lost ones owed
            self.core.weight_sync.push(self.core.policy_version)

        self.surviving(push, f"the weight push to v{self.core.policy_version}", Exception)

    def checkpoint_state(self) -> AsyncState:
        """Pause, and take the queue and the prompts in flight (call between steps). An
        engine lost meanwhile is dropped, and the prompts it held are in flight on the
        others by the time they are taken."""

        def paused_in_flight() -> list[Admitted]:
            self.wait_for_rollout()
            join(self.rollout.run("pause"))
            return [a for rank in join(self.rollout.run("snapshot")) for a in rank]

        in_flight = self.surviving(paused_in_flight, "the checkpoint's pause")
        queued = join([self.queue.snapshot.remote()])[0]
        self.surviving(lambda: join(self.rollout.run("resume")), "the resume after a checkpoint")
        return AsyncState(self.admission.state(), queued, in_flight)
