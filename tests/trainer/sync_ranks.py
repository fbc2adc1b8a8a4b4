"""The processes of the weight-sync tests: one sender and two receivers over gloo.

Kept apart from the test module so that each spawned process imports only torch and
`weight_sync` (not transformers): the processes start in a few seconds on a small
machine. Every function here runs in a child; results come back pickled.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from rlhf_trainer.rollout import weight_sync
from rlhf_trainer.rollout.weight_sync import (
    SyncGroup,
    WeightSpec,
    receive_specs,
    receive_weights,
    send_specs,
    send_weights,
)
from rlhf_trainer.worker import free_port

WORLD_SIZE = 3  # one sender, two receivers
TIMEOUT = timedelta(seconds=60)  # a hung collective fails the test instead of hanging it


def spawn(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run fn(rank, port, *args) in WORLD_SIZE processes; their results in rank order.
    An exception in any of them fails the call with its traceback."""
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as results:
        mp.spawn(
            _main,
            args=(fn, free_port(), Path(results), args),
            nprocs=WORLD_SIZE,
            join=True,
        )
        return [
            torch.load(Path(results) / f"rank-{rank}.pt", weights_only=False)
            for rank in range(WORLD_SIZE)
        ]


def _main(rank: int, fn: Callable[..., Any], port: int, results: Path, args: tuple[Any]) -> None:
    torch.set_num_threads(1)
    torch.save(fn(rank, port, *args), results / f"rank-{rank}.pt")


class AllocationRecorder:
    """Stands in for weight_sync._allocate and notes the size of every buffer."""

    def __init__(self) -> None:
        self.original = weight_sync._allocate
        self.sizes: list[int] = []

    def __call__(self, nbytes: int, device: torch.device) -> Tensor:
        buffer = self.original(nbytes, device)
        self.sizes.append(buffer.nbytes)
        return buffer


class RecordingLoader:
    """An engine's loader: copies the weights and notes what each call brought."""

    def __init__(self) -> None:
        self.weights: dict[str, Tensor] = {}
        self.calls: list[list[str]] = []
        self.storages: set[tuple[int, int]] = set()  # (address, bytes) the views are in

    def __call__(self, views: list[tuple[str, Tensor]]) -> None:
        self.calls.append([name for name, _ in views])
        for name, view in views:
            storage = view.untyped_storage()
            self.storages.add((storage.data_ptr(), storage.nbytes()))
            self.weights[name] = view.clone()


def sync_versions(
    rank: int,
    port: int,
    versions: list[dict[str, Tensor]],
    specs: list[WeightSpec],
    bucket_bytes: int,
) -> dict[str, Any]:
    """Several versions in a row on one group, with no default process group; the
    receivers get the specs out of band (as arguments, as through Ray)."""
    recorder = AllocationRecorder()
    weight_sync._allocate = recorder
    out: dict[str, Any] = {"loaders": [], "stats": []}
    with SyncGroup.create("127.0.0.1", port, rank, WORLD_SIZE, timeout=TIMEOUT) as group:
        for weights in versions:
            if group.is_sender:
                out["stats"].append(send_weights(group, weights, bucket_bytes))
            else:
                loader = RecordingLoader()
                out["stats"].append(receive_weights(group, specs, bucket_bytes, loader))
                out["loaders"].append(loader)
    out["allocations"] = recorder.sizes
    out["default_group"] = dist.is_initialized()
    return out


def sync_beside_default_group(
    rank: int,
    port: int,
    weights: dict[str, Tensor],
    specs: list[WeightSpec],
    bucket_bytes: int,
) -> dict[str, Any]:
    """Each process first has a default group of its own (size 1, rank 0); the specs
    go in band; then a receiver passes wrong specs, and then all sync once more."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    default = dist.group.WORLD
    groups_before = list(dist.distributed_c10d._world.pg_map)
    out: dict[str, Any] = {}
    with SyncGroup.create("127.0.0.1", port, rank, WORLD_SIZE, timeout=TIMEOUT) as group:
        out["sync_rank_size"] = (group.rank, group.world_size)
        if group.is_sender:
            send_specs(group, specs)
            send_weights(group, weights, bucket_bytes)
        else:
            loader = RecordingLoader()
            receive_weights(group, receive_specs(group), bucket_bytes, loader)
            out["weights"] = loader.weights
        try:
            if group.is_sender:
                send_weights(group, weights, bucket_bytes)
            else:
                wrong = specs[::-1] if rank == 2 else specs
                receive_weights(group, wrong, bucket_bytes, RecordingLoader())
        except ValueError as error:
            out["mismatch"] = str(error)
        if group.is_sender:
            send_weights(group, weights, bucket_bytes)
        else:
            again = RecordingLoader()
            receive_weights(group, specs, bucket_bytes, again)
            out["again"] = again.weights
        out["default_during"] = (dist.get_rank(), dist.get_world_size())
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # the default group still works
    out["default_after"] = (dist.get_rank(), dist.get_world_size(), float(total.item()))
    out["same_default"] = dist.group.WORLD is default
    out["groups_unchanged"] = list(dist.distributed_c10d._world.pg_map) == groups_before
    dist.destroy_process_group()
    return out
