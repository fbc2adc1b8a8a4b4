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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from rlhf_env.rewards import ScoredSample
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.cluster.groups import WorkerGroup, join_watching
from rlhf_trainer.cluster.hangs import RanksLost
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.data.prompts import Prompt, PromptStream
from rlhf_trainer.loop.dynamic_sampling import keep_informative_groups
from rlhf_trainer.loop.scores_ahead import QueueArrivals
from rlhf_trainer.loop.setup import RunParts
from rlhf_trainer.loop.sync import Batch, PPOTrainer, StepResult, rollout_input, split_list
from rlhf_trainer.rollout.queue import AdmissionControl, Admitted
from rlhf_trainer.rollout.samples import Sample, group_staleness

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
        self.engines = parts.engines
        self.admissions = Admissions(parts)
        self.engines.listen(self.admissions)

    @property
    def rollout(self) -> WorkerGroup:
        """The rollout engines that serve (those lost are gone from it)."""
        return self.engines.serving

    @property
    def prompts(self) -> PromptStream:
        return self.core.prompts

    def start(self, resumed: AsyncState | None = None) -> None:
        """Admit the first prompts (or what a checkpoint had outstanding)."""
        if resumed is not None:
            self.push_weights()  # the engines start from the initial weights
            self.admission.restore(resumed.admission)
            join([self.queue.restore.remote(resumed.queued)])
            self.admissions.give(resumed.in_flight)
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
        samples = self.engines.surviving(
            lambda: join_watching(taken, self.rollout), "the batch's wait"
        )
        if samples is None:
            raise TimeoutError(f"no batch of samples within {QUEUE_TIMEOUT_S:g} s")
        self.groups_taken += groups
        self.admissions.ledger.taken(s.uid for s in samples)
        return sorted(samples, key=lambda sample: sample.uid)

    def change_engines(self) -> None:
        """Between the trainer's calls to the engines: drop those that died since, and
        take in those started on GPUs that joined the pool once they are up."""
        self.engines.drop_dead()
        if (joining := self.engines.ready_to_join()) is not None:
            self.wait_for_rollout()  # its admissions are one per engine
            self.engines.join(joining)

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
        self.admissions.give(
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
        self.engines.surviving(
            lambda: self.admissions.wait_for_admissions(timeout_s), "the admissions"
        )

    def sync_weights(self) -> None:
        """Hand the new policy to the engines; in-flight requests continue on it
        (partial rollout), or finish on the old one first without partial rollout.
        Then admit what the staleness limit allows."""
        started = time.time()
        self.change_engines()
        assert self.config.async_ is not None
        if not self.config.async_.partial_rollout:
            self.wait_for_rollout()
            self.engines.surviving(lambda: join(self.rollout.run("drain")), "the drain")
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

        self.engines.surviving(push, f"the weight push to v{self.core.policy_version}", Exception)

    def checkpoint_state(self) -> AsyncState:
        """Pause, and take the queue and the prompts in flight (call between steps). An
        engine lost meanwhile is dropped, and the prompts it held are in flight on the
        others by the time they are taken."""

        def paused_in_flight() -> list[Admitted]:
            self.wait_for_rollout()
            join(self.rollout.run("pause"))
            return [a for rank in join(self.rollout.run("snapshot")) for a in rank]

        in_flight = self.engines.surviving(paused_in_flight, "the checkpoint's pause")
        queued = join([self.queue.snapshot.remote()])[0]
        self.engines.surviving(
            lambda: join(self.rollout.run("resume")), "the resume after a checkpoint"
        )
        return AsyncState(self.admission.state(), queued, in_flight)


class Admissions:
    """What each engine was given and has not handed back: the ledger (by uid) and the
    admissions not yet acknowledged (by engine). Told of engines lost, it stops waiting
    on theirs, and gives what they owed to those that serve once they serve again."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.queue = parts.queue
        self.ledger = EngineLedger()
        # The admissions given since the last wait, by engine rank: the trainer goes on
        # without waiting for them, and waits before its next sync.
        self.admissions: list[tuple[int, Any]] = []

    def give(self, admitted: list[Admitted]) -> None:
        """Give `admitted` to the engines that serve, in even shards, noting which
        engine holds which. An engine runs its calls in order, so no admission waits
        for another."""
        if not admitted:
            return
        group = self.parts.groups[Role.ROLLOUT]
        shards = split_list(admitted, group.world_size)
        self.ledger.assign(group.ranks, shards)
        self.admissions += zip(group.ranks, group.run_each("admit", shards), strict=True)

    def wait_for_admissions(self, timeout_s: float) -> None:
        """Wait for the admissions since the last wait (they return at once); raises
        what an engine that died in one raised, keeping the others to wait for."""
        join([call for _, call in self.admissions], timeout_s)
        self.admissions = []

    def forget(self, ranks: Sequence[int]) -> None:
        self.admissions = [(rank, call) for rank, call in self.admissions if rank not in ranks]

    def rehome(self, ranks: Sequence[int], version: int) -> None:
        """What the engines of `ranks` owed, and the queue has not received, admitted
        again to those that serve (the queue keeps a uid once: a late answer from a lost
        engine is not trained twice)."""
        owed = join([self.queue.not_received.remote(self.ledger.held_by(ranks))])[0]
        serving = self.parts.groups[Role.ROLLOUT]
        log.warning("%s: going on with %d engine(s); %d sample(s) they owed are generated "
                    "again on them", RanksLost(Role.ROLLOUT, serving.pool, ranks),
                    serving.world_size, len(owed))  # fmt: skip
        self.parts.metrics.samples_readmitted.inc(len(owed))
        self.give(self.ledger.admitted(owed))


class EngineLedger:
    """Which engine (by its rank) was given which prompt, until the trainer takes it."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, Admitted]] = {}  # uid -> (engine rank, admitted)

    def assign(self, ranks: Sequence[int], shards: Sequence[Sequence[Admitted]]) -> None:
        """Engine ranks[i] was given shards[i]."""
        for rank, shard in zip(ranks, shards, strict=True):
            for admitted in shard:
                self._held[admitted[0]] = (rank, admitted)

    def taken(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self._held.pop(uid, None)

    def held_by(self, ranks: Iterable[int]) -> list[int]:
        """The uids given to the engines of `ranks` and not taken yet, in order."""
        lost = set(ranks)
        return sorted(uid for uid, (rank, _) in self._held.items() if rank in lost)

    def admitted(self, uids: Iterable[int]) -> list[Admitted]:
        """What admitted `uids`, to give them to other engines."""
        return [self._held[uid][1] for uid in uids]

    def __len__(self) -> int:
        return len(self._held)
