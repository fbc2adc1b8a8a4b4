"""Toy role workers for the placement tests: plain Python, as a real role's is."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import Tensor

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
