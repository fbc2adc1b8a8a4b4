"""Toy role workers for the placement tests: plain Python, as a real role's is."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ray
import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.rollout.transfer_memory import Relay, Segments
from rlhf_trainer.rollout.weight_sync import HOST_TRANSFER, Bucket, EngineTransfer, TransferSetup
from rlhf_trainer.telemetry.engine_stats import EngineStats
from rlhf_trainer.worker import RankInfo, Worker

if TYPE_CHECKING:  # rollout.worker imports vLLM: seconds in every toy rank's process
    from rlhf_trainer.rollout.worker import BatchShard


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

    def whose(self) -> tuple[str, int]:
        """(role, rank) of the worker that answers: which one a host routed the call to."""
        return self.info.role, self.info.rank

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

    def die_in_all_reduce(self, dying_rank: int, seen_first: str = "") -> float:
        """Every rank joins an all_reduce but `dying_rank` exits first: the others are
        left waiting in the collective for a peer that will never come.

        With `seen_first` (a path): the death reaches the others first as their
        collective's own error. The dying rank closes its connections and exits only
        once a peer has failed (the peer creates `seen_first`)."""
        if self.info.rank == dying_rank:
            if seen_first:
                dist.destroy_process_group()
                while not os.path.exists(seen_first):
                    time.sleep(0.05)
            os._exit(1)
        token = torch.ones(1)
        try:
            dist.all_reduce(token)
        except RuntimeError:
            if seen_first:
                open(seen_first, "x").close()
            raise
        return float(token.item())


GO_AHEAD_S = 120.0  # how long count_up waits for the test's word after its first result


class BusyEngine(Worker):
    """Stands in for a rollout worker: an engine's stats (rank-dependent), and a call
    that keeps the rank busy."""

    needs_process_group = False

    def engine_stats(self) -> EngineStats:
        rank = self.info.rank
        return EngineStats(rank, 0, 0.5, generation_tokens=100 + rank, prompt_tokens=10)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def count_up(self, shard: list[int], go_ahead: str, dying_rank: int = -1) -> Iterator[Any]:
        """Yields (value, rank) for each value of its shard, as a rollout rank yields
        samples as they finish: the first at once, the rest once the file `go_ahead`
        exists (the test's word). Rank `dying_rank` exits instead of yielding the rest.
        No word within GO_AHEAD_S fails the call: a reader that waits for whole calls
        then fails the test, naming this, instead of hanging it."""
        yield shard[0], self.info.rank
        deadline = time.monotonic() + GO_AHEAD_S
        while not os.path.exists(go_ahead):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.info.rank}: no go-ahead in {GO_AHEAD_S:g} s")
            time.sleep(0.05)
        if self.info.rank == dying_rank:
            os._exit(1)
        for value in shard[1:]:
            yield value, self.info.rank


class HeldRollout(BusyEngine):
    """Stands in for a synchronous step's rollout rank (RolloutWorker): `generate` yields
    its shard's first sample at once and the rest once the file `go_ahead` exists, as
    count_up does. A sample's one response token is its prompt's first token + 100."""

    def __init__(self, info: RankInfo, go_ahead: str) -> None:
        super().__init__(info)
        self.go_ahead = go_ahead

    def generate(
        self, shard: BatchShard, step: int, attempt: int = 0
    ) -> Iterator[tuple[int, Rollout]]:
        def sample(prompt: list[int]) -> Rollout:
            return Rollout(prompt, [prompt[0] + 100], [0.0], finished=True, policy_version=0)

        held = self.count_up(list(range(len(shard.inputs))), self.go_ahead)
        for place, _ in held:
            yield place, sample(shard.inputs[place])


TOY_WEIGHTS = {"embed": torch.arange(12.0).reshape(3, 4), "head": torch.ones(4)}


class WeightSender(Worker):
    """Stands in for the actor in a weight transfer: rank 0 sends TOY_WEIGHTS with the
    host backend's trainer engine, through vLLM's factory, as the actor does."""

    needs_process_group = False

    def open_weight_transfer(self, setup: TransferSetup, engines: Any) -> None:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from rlhf_trainer.rollout.transfer_engines import trainer_init_info

        class ToySource(WeightSource):  # type: ignore[misc]
            def metadata(self) -> list[Any]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in TOY_WEIGHTS.items()]

            def __iter__(self) -> Iterator[tuple[str, Tensor]]:
                return iter(TOY_WEIGHTS.items())

        info = trainer_init_info(self.info.rank, setup)
        self.engines = engines
        self.transfer = WeightTransferTrainerFactory.trainer_init(
            info, client=engines, source=ToySource()
        )

    def send_weights(self, version: int) -> None:
        self.engines.version = version
        self.transfer.send_weights()


class StoppingReceiver(Worker):
    """Stands in for a rollout engine in a weight transfer. Rank `stopping_rank` stops
    its own process (SIGSTOP) when an update starts, as a hung or frozen engine would;
    with `dies`, its process exits at the first bucket instead, as a crashed one would."""

    needs_process_group = False

    def __init__(self, info: RankInfo, stopping_rank: int, dies: bool = False) -> None:
        super().__init__(info)
        self.stopping_rank = stopping_rank
        self.dies = dies
        self.segments = Segments()

    def pid(self) -> int:
        return os.getpid()

    def weight_transfer(self) -> EngineTransfer:
        return EngineTransfer(HOST_TRANSFER, workers=1)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.relay = Relay.join(init_info, self.info.rank)

    def start_weight_update(self) -> None:
        if self.info.rank == self.stopping_rank and not self.dies:
            os.kill(os.getpid(), signal.SIGSTOP)
            # The stop can land a moment after kill returns (another thread takes the
            # signal): the call must not answer meanwhile.
            while True:
                time.sleep(60)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.info.rank == self.stopping_rank and self.dies:
            os._exit(1)
        bucket = Bucket.from_dict(update_info)
        if self.relay is not None:
            bucket = self.relay.receive(bucket)
        self.segments.read(bucket)

    def finish_weight_update(self, weight_version: int) -> None:
        self.segments.prune()


class LosingReceiver(StoppingReceiver):
    """Stands in for the rollout engines of a push that loses one. At its first bucket
    rank 0's process exits, as a crashed engine's does, and rank 1's receive never
    returns: rank 1 stands in for a vLLM worker in an NCCL receive whose sender
    aborted, which waits for ever (NCCL tells no peer of an abort). The host transfer's
    gloo would end that receive with an error, so it cannot show this. Their
    replacements (ranks 2 and on) take every push whole, and say what they serve."""

    def __init__(self, info: RankInfo) -> None:
        super().__init__(info, stopping_rank=-1)
        self.loaded: dict[str, Tensor] = {}
        self.serves: tuple[int, dict[str, Tensor]] | None = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.info.rank == 0:
            os._exit(1)
        if self.info.rank == 1:
            threading.Event().wait()  # only its process's end ends it
        bucket = Bucket.from_dict(update_info)
        if self.relay is not None:
            bucket = self.relay.receive(bucket)
        self.loaded |= {name: view.clone() for name, view in self.segments.read(bucket)}

    def finish_weight_update(self, weight_version: int) -> None:
        self.serves, self.loaded = (weight_version, self.loaded), {}
        super().finish_weight_update(weight_version)

    def abandon_weight_update(self) -> None:
        self.loaded = {}

    def serving(self) -> tuple[int, dict[str, Tensor]] | None:
        """The version this engine serves, and its weights."""
        return self.serves


def wait_until_dead(host: Any, timeout_s: float = 60) -> None:
    """ray.kill lands asynchronously: a call made at once may still be answered (a cold
    CI run here saw the killed rank's stats come back once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(host.whereabouts.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed rank still answers")


# What a tensor-parallel engine's core (a child of its rank's process) does on the
# cluster, as vLLM's Ray executor does it: join the cluster at RAY_ADDRESS, and run one
# worker in each of the engine's bundles (VLLM_RAY_BUNDLE_INDICES) at its GPU share
# (VLLM_RAY_PER_WORKER_GPUS). Prints the GPU ids Ray gave each worker.
ENGINE_CORE_STAND_IN = """
import json, os, sys
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# vLLM hands its core the placement group itself; this looks it up by name, in the
# rank's namespace.
ray.init(address=os.environ["RAY_ADDRESS"], namespace=sys.argv[2], logging_level="ERROR")
group = ray.util.get_placement_group(sys.argv[1])
bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])

@ray.remote
def gpu_ids():
    return ray.get_runtime_context().get_accelerator_ids()["GPU"]

placed = [gpu_ids.options(num_cpus=0, num_gpus=share,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(group, b)).remote()
          for b in bundles]
print(json.dumps(ray.get(placed, timeout=60)))
"""


class TensorParallelRank(Worker):
    """Stands in for a rollout rank whose engine has tensor parallelism: what its
    process sees, and what its engine's core (`ENGINE_CORE_STAND_IN`) gets of Ray."""

    needs_process_group = False

    def seen(self) -> dict[str, Any]:
        keys = ("VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS", "RAY_ADDRESS")
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return {"environment": {k: os.environ.get(k) for k in keys}, "gpus": gpus}

    def start_engine_core(self, placement_group: str) -> list[list[str]]:
        import json
        import subprocess
        import sys

        namespace = ray.get_runtime_context().namespace
        done = subprocess.run([sys.executable, "-c", ENGINE_CORE_STAND_IN, placement_group,
                               namespace], capture_output=True, text=True, timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the engine core's stand-in failed: {done.stderr[-2000:]}")
        ids: list[list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
        return ids
