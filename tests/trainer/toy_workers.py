"""Toy role workers for the placement tests: plain Python, as a real role's is."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_trainer.rollout.weight_sync import (
    WeightSpec,
    open_sync_group,
    receive_copies,
    send_weights,
    weight_specs,
)
from rlhf_trainer.telemetry.engine_stats import EngineStats
from rlhf_trainer.worker import RankInfo, Worker


class PartialSums(Worker):
    def __init__(self, info: RankInfo) -> None:
        super().__init__(info)
        # The process group is up before the constructor: a collective here must work.
        token = torch.ones(1)
        dist.all_reduce(token)
        self.group_size_seen = int(token.item())

    def total_sum(self, shard: Tensor) -> float:
        """This rank's partial sum, all-reduced over the ranks: the sum of the batch."""
        partial = shard.sum().reshape(1).to(torch.float64)
        dist.all_reduce(partial)
        return float(partial.item())

    def doubled(self, shard: Tensor) -> Tensor:
        """(N, 2) per row: twice the value and this rank, for gather to put in rank order."""
        return torch.stack([shard * 2, torch.full_like(shard, self.info.rank)], dim=1)

    def sleep(self, seconds: float) -> tuple[float, float]:
        """Start and end, wall clock, for the test to check two pools overlapped."""
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def die_in_all_reduce(self, dying_rank: int) -> float:
        """Every rank joins an all_reduce but `dying_rank` exits first: the others are
        left waiting in the collective for a peer that will never come."""
        if self.info.rank == dying_rank:
            os._exit(1)
        token = torch.ones(1)
        dist.all_reduce(token)
        return float(token.item())


class BusyEngine(Worker):
    """Stands in for a rollout worker: an engine's stats (rank-dependent), and a call
    that keeps the rank busy."""

    needs_process_group = False

    def engine_stats(self) -> EngineStats:
        rank = self.info.rank
        return EngineStats(rank, 0, 0.5, generation_tokens=100 + rank, prompt_tokens=10)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


TOY_WEIGHTS = {"embed": torch.arange(12.0).reshape(3, 4), "head": torch.ones(4)}


class WeightSender(Worker):
    """Stands in for the actor in a weight sync: rank 0 sends TOY_WEIGHTS."""

    needs_process_group = False

    def open_weight_sync(
        self, host: str, port: int, world_size: int, device: str, timeout_s: float
    ) -> list[WeightSpec] | None:
        if self.info.rank != 0:
            return None
        self.sync_group = open_sync_group(host, port, 0, world_size, device, timeout_s)
        return weight_specs(TOY_WEIGHTS)

    def send_weights(self, bucket_bytes: int) -> None:
        if self.info.rank == 0:
            send_weights(self.sync_group, TOY_WEIGHTS, bucket_bytes)


class StoppingReceiver(Worker):
    """Stands in for a rollout engine in a weight sync. Rank `stopping_rank` stops its
    own process (SIGSTOP) when a transfer starts, as a hung or frozen engine would."""

    needs_process_group = False

    def __init__(self, info: RankInfo, stopping_rank: int) -> None:
        super().__init__(info)
        self.stopping_rank = stopping_rank

    def pid(self) -> int:
        return os.getpid()

    def open_weight_sync(
        self, host: str, port: int, world_size: int, device: str, timeout_s: float
    ) -> None:
        rank = 1 + self.info.rank
        self.sync_group = open_sync_group(host, port, rank, world_size, device, timeout_s)

    def receive_weights(self, specs: list[WeightSpec], bucket_bytes: int, version: int) -> None:
        if self.info.rank == self.stopping_rank:
            os.kill(os.getpid(), signal.SIGSTOP)
        receive_copies(self.sync_group, specs, bucket_bytes)
