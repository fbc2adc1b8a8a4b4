"""bench/overhead's bare FSDP2 loop is handed, rank by rank, the micro-batches the job's
actor trains on (`rank_plan`), so the training ratio compares the same work: checked
against `Trainable.update` itself, for each rank of two. (One process, in a gloo group of
one: the ranks' only collective, the token count's all-reduce, changes no cut.)"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from bench.overhead.job import ACTOR_RANKS, job
from bench.overhead.training import experience_of, rank_plan
from rlhf_trainer.algo.experience import Experience, Rollout
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.roles.trainable import Stats, Trainable
from rlhf_trainer.rollout.samples import Sample
from rlhf_trainer.worker import RankInfo, free_port, init_distributed


class MicroBatchRecorder(Trainable):
    """A trainable role whose loss only records the micro-batch it is given."""

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info, config)
        self.model = nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.seen: list[Experience] = []

    def loss(self, micro: Experience, normalizer: Tensor) -> tuple[Tensor, Stats]:
        self.seen.append(micro)
        return (self.model.weight * 0).sum(), {"rows": float(len(micro))}


def samples(count: int) -> list[Sample]:
    """Long-tailed responses, as the bench's tiny policy gives."""
    rng = random.Random(0)
    made = []
    for uid in range(count):
        length = min(192, 1 + int(rng.expovariate(1 / 50)))
        prompt = [rng.randrange(64) for _ in range(rng.randrange(4, 16))]
        response = [rng.randrange(64) for _ in range(length)]
        rollout = Rollout(prompt, response, [-4.0] * length, True, 0, ((0, 0),))
        made.append(Sample(uid, uid // 4, rollout, (0,)))
    return made


def same_micro_batches(rank: int, config: JobConfig, experience: Experience) -> bool:
    world = ACTOR_RANKS
    actor = MicroBatchRecorder(RankInfo(Role.ACTOR, "train", rank, world), config)
    planned = []
    for step in (1, 2, 3):  # the step seeds each update's mini-batches
        actor.update(experience.split(world)[rank], step)
        planned += [
            micro for mini in rank_plan(experience, config, step, rank, world) for micro in mini
        ]
    return len(planned) == len(actor.seen) and all(
        a.input_ids.shape == b.input_ids.shape
        and torch.equal(a.input_ids, b.input_ids)
        and torch.equal(a.advantages, b.advantages)
        for a, b in zip(planned, actor.seen, strict=True)
    )


def test_the_bare_loop_gets_the_micro_batches_the_actor_trains_on(tmp_path: Path) -> None:
    config = job(tmp_path)
    experience = experience_of(samples(config.samples_per_step), pad_id=0)
    plan = rank_plan(experience, config, 1, 0, ACTOR_RANKS)
    # Cut as the actor cuts: several mini-batches of several micro-batches, each trimmed.
    assert len(plan) > 1 and all(len(mini) > 1 for mini in plan)
    widths = {micro.input_ids.shape[1] for mini in plan for micro in mini}
    assert len(widths) > 1
    init_distributed(RankInfo(Role.ACTOR, "train", 0, 1), "127.0.0.1", free_port())
    try:
        for rank in range(ACTOR_RANKS):
            assert same_micro_batches(rank, config, experience), f"rank {rank}"
    finally:
        dist.destroy_process_group()
