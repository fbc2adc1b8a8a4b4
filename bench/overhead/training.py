"""The training ratio: samples/s of the job's actor update (forward, backward, optimizer)
against a bare FSDP2 loop on the same model, micro-batches and ranks.

    job    the run's actor ranks (Ray actors), called as the step calls them
           (`run_sharded("update", experience, step)`), one call per update, timed from
           the driver: the Ray call and the batch's hand-off, the actor's loss (the
           clipped policy loss with entropy and importance weights, its statistics),
           the global token count (an all-reduce), gradient clipping, AdamW
    torch  as many processes as the job has actor ranks, each one torch thread (as a
           rank on CPU), gloo, the model built from the same config and seed,
           `fully_shard` per decoder layer and at the root, AdamW; each rank is handed
           the micro-batches the actor's rank would cut (`rank_plan`), and runs
           forward, the clipped policy loss, backward, gradient clipping and the
           optimizer step; timed from the hand-off until every rank has run them all

The same experience (the job's own first samples, random advantages) and the same step
numbers go to both, so each update sees the same mini-batches, row for row. The job
side also reports the share of its time spent inside the ranks' calls, and the weight
push into the idle engine that the async step makes every triggerParameterSyncStep
steps (apart: the rollout ratio excludes it).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.harness import Measurement
from bench.overhead.cpu import tree_cpu_seconds
from rlhf_trainer.algo.experience import Experience, micro_batch_rows, minibatches, pack_rollouts
from rlhf_trainer.algo.ppo import clipped_policy_loss, log_probs_from_logits
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.loop.sync import PPOTrainer
from rlhf_trainer.roles.trainable import load_policy
from rlhf_trainer.rollout.samples import Sample
from rlhf_trainer.worker import CPU_THREADS_PER_RANK, derive_seed, free_port

RankPlan = list[list[Experience]]  # an update's mini-batches, each its micro-batches


def experience_of(samples: Sequence[Sample], pad_id: int) -> Experience:
    """The samples packed as the step packs them, the engine's log-probs as π_old and a
    random advantage per sample (seeded): what the update computes does not depend on
    the values."""
    batch = pack_rollouts([s.rollout for s in samples], pad_id)
    advantages = torch.randn(len(samples), 1, generator=torch.Generator().manual_seed(0))
    return Experience.of(
        batch,
        old_log_probs=batch.rollout_log_probs,
        advantages=advantages * batch.response_mask,
    )


def rank_plan(
    experience: Experience, config: JobConfig, step: int, rank: int, world: int
) -> RankPlan:
    """The micro-batches that the actor's rank `rank` trains on at `step`, as
    `Trainable.update` cuts them: its shard, mini-batches drawn with the same seed,
    micro-batches of similar lengths, each trimmed to its own width."""
    trainer = config.trainer
    shard = experience.split(world)[rank]  # as the group shards it (worker.split_batch)
    generator = torch.Generator().manual_seed(derive_seed(trainer.seed, "minibatches", step, rank))
    plan: RankPlan = []
    for _ in range(trainer.epochs):
        for indices in minibatches(len(shard), trainer.mini_batch_size // world, generator):
            mini = shard.select(indices)
            rows = micro_batch_rows(mini, trainer.micro_batch_size)
            plan.append([mini.select(r).trimmed()[0] for r in rows])
    return plan


class JobTraining:
    """The job's actor ranks, `updates` updates a measurement, then one weight push."""

    def __init__(
        self, core: PPOTrainer, experience: Experience, updates: int, cpu: Callable[[], float]
    ) -> None:
        self.core, self.experience, self.updates = core, experience, updates
        self.cpu = cpu  # the job's processes' CPU-seconds so far
        self.step = 0

    def measure(self) -> Measurement:
        actor = self.core.groups[Role.ACTOR]
        join(actor.drain_calls())  # forget the calls before
        started, cpu = time.perf_counter(), self.cpu()
        for _ in range(self.updates):
            self.step += 1
            join(actor.run_sharded("update", self.experience, self.step, phase=Phase.UPDATE_ACTOR))
        seconds, cpu_s = time.perf_counter() - started, self.cpu() - cpu
        in_ranks = [
            sum(end - start for _, start, end in calls) for calls in join(actor.drain_calls())
        ]
        self.core.policy_version += 1
        pushed = time.perf_counter()
        self.core.weight_sync.push(self.core.policy_version)
        return {
            "samples_per_s": self.updates * len(self.experience) / seconds,
            "samples_per_cpu_s": self.updates * len(self.experience) / cpu_s,
            "update_s": seconds / self.updates,
            "in_rank_share": sum(in_ranks) / len(in_ranks) / seconds,
            "push_s": time.perf_counter() - pushed,
        }


class BareTorch:
    """The bare FSDP2 loop's ranks: processes of their own (spawned, so they start
    without this process's state), kept for every measurement."""

    def __init__(self, config: JobConfig, experience: Experience, updates: int, world: int) -> None:
        self.config, self.experience, self.updates, self.world = config, experience, updates, world
        self.step = 0
        context = mp.get_context("spawn")
        port = free_port()
        self.pipes: list[Connection] = []
        self.processes = []
        for rank in range(world):
            ours, theirs = context.Pipe()
            process = context.Process(target=bare_rank, args=(config, rank, world, port, theirs))
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)
        for pipe in self.pipes:
            pipe.recv()  # built and sharded

    def measure(self) -> Measurement:
        steps = range(self.step + 1, self.step + self.updates + 1)
        self.step += self.updates
        plans = [
            [rank_plan(self.experience, self.config, step, rank, self.world) for step in steps]
            for rank in range(self.world)
        ]
        started, cpu = time.perf_counter(), self.cpu_seconds()
        for pipe, plan in zip(self.pipes, plans, strict=True):
            pipe.send(plan)
        for pipe in self.pipes:
            pipe.recv()
        seconds, cpu_s = time.perf_counter() - started, self.cpu_seconds() - cpu
        return {
            "samples_per_s": self.updates * len(self.experience) / seconds,
            "samples_per_cpu_s": self.updates * len(self.experience) / cpu_s,
            "update_s": seconds / self.updates,
        }

    def cpu_seconds(self) -> float:
        return sum(tree_cpu_seconds(p.pid) for p in self.processes if p.pid is not None)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(timeout=30)


def bare_rank(config: JobConfig, rank: int, world: int, port: int, pipe: Connection) -> None:
    """One rank of the bare loop: build, shard, then run each list of updates it is sent."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(CPU_THREADS_PER_RANK)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model: Any = load_policy(config.models.actor, config.trainer.seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.actor_learning_rate)
    model.train()
    pipe.send("ready")
    while (updates := pipe.recv()) is not None:
        for plan in updates:
            bare_update(model, optimizer, plan, config)
        pipe.send("done")
    dist.destroy_process_group()


def bare_update(
    model: nn.Module, optimizer: torch.optim.Optimizer, plan: RankPlan, config: JobConfig
) -> None:
    """A plain PPO update: per mini-batch, the clipped policy loss of each micro-batch
    (a token mean over the mini-batch), backward, clipping, AdamW."""
    algorithm, temperature = config.algorithm, config.generation.temperature
    low, high = algorithm.clip_range()
    for mini in plan:
        optimizer.zero_grad(set_to_none=True)
        tokens = sum(float(micro.response_mask.sum()) for micro in mini)
        for micro in mini:
            mask = micro.attention_mask
            positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
            logits = model(
                input_ids=micro.input_ids, attention_mask=mask, position_ids=positions
            ).logits
            log_probs = log_probs_from_logits(logits[:, :-1] / temperature, micro.input_ids[:, 1:])
            log_probs = nn.functional.pad(log_probs, (1, 0))
            loss = clipped_policy_loss(
                log_probs, micro.old_log_probs, micro.advantages, low, high, algorithm.dual_clip
            ).loss
            ((loss * micro.response_mask).sum() / max(tokens, 1.0)).backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), config.trainer.max_grad_norm)
        optimizer.step()
