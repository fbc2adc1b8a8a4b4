"""The actor update's own work, made cheaper (issue 76), computes what it did: the
micro-batches cut once per update from the rank's shard, the mini-batches' token counts
in one all-reduce, the gradient norm without a gather, and each rank's shard handed
over in tensors of its own. Each checked against the naive version it replaced."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from bench.overhead.job import job
from rlhf_trainer.algo.experience import (
    Experience,
    Rollout,
    micro_batch_rows,
    minibatches,
    pack_rollouts,
)
from rlhf_trainer.algo.ppo import aggregation_normalizer
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.cluster.groups import WorkerGroup, own_storage
from rlhf_trainer.roles.policy import Actor
from rlhf_trainer.roles.sharding import clip_gradients, shard_model
from rlhf_trainer.roles.trainable import Stats, Trainable, all_ranks_sum, update_plan
from rlhf_trainer.worker import RankInfo, derive_seed, free_port, init_distributed, split_batch


def experience(rows: int, seed: int = 0) -> Experience:
    """Long-tailed responses (ties among the lengths too), random old log-probs and
    advantages, some rows with no counted token."""
    rng = random.Random(seed)
    rollouts = []
    for _ in range(rows):
        length = min(40, 1 + int(rng.expovariate(1 / 10)))
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(2, 6))]
        response = [rng.randrange(1, 64) for _ in range(length)]
        loss_mask = tuple(int(rng.random() > 0.2) for _ in range(length))
        rollouts.append(Rollout(prompt, response, [-1.0] * length, True, 0, loss_mask=loss_mask))
    batch = pack_rollouts(rollouts, pad_id=0)
    generator = torch.Generator().manual_seed(seed)
    old = (torch.randn(batch.input_ids.shape, generator=generator) - 3) * batch.response_mask
    advantages = torch.randn(rows, 1, generator=generator) * batch.response_mask
    return Experience.of(replace(batch, rollout_log_probs=old - 0.01), old_log_probs=old,
                         advantages=advantages)  # fmt: skip


@pytest.fixture
def gloo_of_one() -> Iterator[None]:
    init_distributed(RankInfo(Role.ACTOR, "train", 0, 1), "127.0.0.1", free_port())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [None, 1, 3, 4])
def test_the_update_plan_cuts_each_mini_batch_as_micro_batch_rows_does(size: int | None) -> None:
    batch = experience(21)
    minis = minibatches(len(batch), 8, torch.Generator().manual_seed(1))
    minis.append(torch.tensor([], dtype=torch.long))  # an empty shard's one mini-batch
    plan = update_plan(batch, minis, size)
    for indices, micro_rows in zip(minis, plan, strict=True):
        naive = micro_batch_rows(batch.select(indices), size)  # rows of the mini-batch
        assert [r.tolist() for r in micro_rows] == [indices[r].tolist() for r in naive]


def naive_update(worker: Trainable, batch: Experience, step: int) -> Stats:
    """`Trainable.update` as it was: each mini-batch copied, then cut, and its count
    all-reduced on its own."""
    trainer, world = worker.config.trainer, worker.info.world_size
    seed = derive_seed(trainer.seed, "minibatches", step, worker.info.rank)
    generator = torch.Generator().manual_seed(seed)
    micro_stats, grad_norms = [], []
    worker.model.train()
    for _ in range(trainer.epochs):
        for indices in minibatches(len(batch), trainer.mini_batch_size // world, generator):
            mini = batch.select(indices)
            mode = worker.config.algorithm.loss_aggregation
            normalizer = all_ranks_sum(aggregation_normalizer(mini.response_mask, mode))
            worker.optimizer.zero_grad(set_to_none=True)
            for rows in micro_batch_rows(mini, trainer.micro_batch_size):
                micro = mini.select(rows).trimmed()[0].to(worker.info.device)
                loss, stats = worker.loss(micro, normalizer)
                (loss * world).backward()  # type: ignore[no-untyped-call]
                micro_stats.append(stats)
            norm = nn.utils.clip_grad_norm_(worker.model.parameters(), trainer.max_grad_norm)
            grad_norms.append(float(norm.full_tensor()))  # type: ignore[attr-defined]
            if normalizer > 0:
                worker.optimizer.step()
    worker.model.eval()
    names = micro_stats[0]
    means = {name: sum(s[name] for s in micro_stats) / len(micro_stats) for name in names}
    return {**means, "grad_norm": sum(grad_norms) / len(grad_norms)}


def actor_config(tmp_path: Path, aggregation: str) -> JobConfig:
    spec = job(tmp_path).model_dump(by_alias=True, exclude_none=True)
    # Two epochs of two mini-batches of two micro-batches (16 rows); clipping acts.
    spec["trainer"] |= {"epochs": 2, "miniBatchSize": 8, "maxGradNorm": 0.05}
    spec["trainer"]["actorLearningRate"] = 1e-3
    spec["algorithm"]["lossAggregation"] = aggregation
    return JobConfig.model_validate(spec)


def weights(model: nn.Module) -> dict[str, Tensor]:
    state = model.state_dict().items()
    return {n: (t.to_local() if isinstance(t, DTensor) else t).clone() for n, t in state}


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_update_trains_and_reports_exactly_what_the_naive_one_did(
    tmp_path: Path, gloo_of_one: None, aggregation: str
) -> None:
    """Two actors from the same seed, one updated as before, one as now: the same
    statistics and the same weights, bit for bit, over two updates."""
    config = actor_config(tmp_path, aggregation)
    info = RankInfo(Role.ACTOR, "train", 0, 1)
    ours, theirs = Actor(info, config), Actor(info, config)
    batch = experience(16, seed=3)
    for step in (1, 2):
        reported, expected = ours.update(batch, step), naive_update(theirs, batch, step)
        assert reported == expected
    after, before = weights(ours.model), weights(theirs.model)
    assert any(not torch.equal(after[n], p) for n, p in weights(Actor(info, config).model).items())
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_the_gradient_norm_is_the_gathered_one(gloo_of_one: None) -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return shard_model(nn.Sequential(*(TinyDecoderLayer() for _ in range(2))))

    ours, theirs = model(), model()
    for m in (ours, theirs):
        m(torch.randn(5, 6, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    norm = clip_gradients(ours, 0.01)
    expected = nn.utils.clip_grad_norm_(theirs.parameters(), 0.01)
    assert norm == float(expected.full_tensor())  # type: ignore[attr-defined]
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor())  # type: ignore[union-attr]


class TinyDecoderLayer(nn.Module):  # found by its name, as a transformer's are
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x))


def pickled(value: Any) -> int:
    return len(pickle.dumps(value))


def test_each_shard_is_pickled_with_its_own_rows_only() -> None:
    batch = experience(32)
    shards = split_batch(batch, 4)
    owned = [own_storage(shard) for shard in shards]
    for shard, mine in zip(shards, owned, strict=True):
        assert mine.tensors().keys() == shard.tensors().keys()
        assert all(torch.equal(t, shard.tensors()[n]) for n, t in mine.tensors().items())
        assert pickled(mine) < pickled(shard) / 3  # a view carried the whole batch
    tensor = torch.arange(12.0).reshape(6, 2)
    halves = [own_storage(half) for half in split_batch(tensor, 2)]
    assert pickled(halves[0]) < pickled(split_batch(tensor, 2)[0])
    assert torch.equal(torch.cat(halves), tensor)
    assert own_storage(tensor) is tensor  # its own already: not copied


def test_run_sharded_hands_each_rank_a_shard_of_its_own() -> None:
    sent: list[Any] = []

    class Host:
        class call:  # a Ray actor method: host.call.remote(...)
            @staticmethod
            def remote(method: str, shard: Any, *args: Any, **kwargs: Any) -> Any:
                sent.append(shard)
                return SimpleNamespace(binary=lambda: bytes(len(sent)))

    slots = [SimpleNamespace(pool="train")] * 2
    group = WorkerGroup(Role.ACTOR, slots, [Host(), Host()], [])  # type: ignore[arg-type]
    batch = experience(8)
    group.run_sharded("update", batch, 1)
    assert [len(shard) for shard in sent] == [4, 4]
    assert all(pickled(shard) < pickled(batch) * 0.75 for shard in sent)
    assert torch.equal(sent[1].input_ids, batch.input_ids[4:])
