"""One rank of a role, as plain Python: what it knows of its place (`RankInfo`), the
base of every role's worker (`Worker`), and its rendezvous with the role's other
ranks (torch.distributed). Batches are sharded over ranks along their first dimension.

A worker runs and is tested without Ray; `cluster.groups` hosts it in a Ray actor.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_trainer.algo.experience import Sequences
from rlhf_trainer.api.config import Role

# A batch is split along its first (batch) dimension: one tensor, or a batch of sequences.
BatchT = TypeVar("BatchT", Tensor, Sequences)

RENDEZVOUS_TIMEOUT = timedelta(minutes=10)  # every rank must join before this
CPU_THREADS_PER_RANK = 1


def split_batch(batch: BatchT, parts: int) -> list[BatchT]:
    """`parts` shards along dim 0, in rank order. Uneven sizes differ by at most one row,
    the first shards larger; with fewer rows than parts the last shards are empty (every
    rank still takes part in the collectives)."""
    if parts < 1:
        raise ValueError(f"cannot split a batch into {parts} parts")
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, parts, dim=0))
    return batch.split(parts)


def concat_batches(shards: Sequence[BatchT]) -> BatchT:
    """The inverse of `split_batch`: the shards re-joined along dim 0, in order."""
    if not shards:
        raise ValueError("no shards to concatenate")
    first = shards[0]
    if isinstance(first, Tensor):
        return torch.cat(list(shards), dim=0)
    return first.concat(shards)


@dataclass(frozen=True)
class RankInfo:
    """What a worker knows about its place in the group."""

    role: Role
    pool: str
    rank: int
    world_size: int

    @property
    def device(self) -> torch.device:
        # Ray shows each worker only its own GPU (CUDA_VISIBLE_DEVICES), so it is cuda:0.
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def distributed_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(info: RankInfo, master_addr: str, master_port: int) -> None:
    """Join the role's process group. The variables are set, not just passed, because
    libraries started later (FSDP, vLLM) read them."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(info.device)
    dist.init_process_group(
        distributed_backend(),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=RENDEZVOUS_TIMEOUT,
    )


def derive_seed(job_seed: int, purpose: str, index: int, rank: int = 0) -> int:
    """The seed of one stream of randomness of a run: `purpose` names the stream (e.g.
    "generate", "sample", "minibatches"), `index` the step or sample, `rank` the rank.

    A function of its arguments only (no `hash()`, which varies between processes), so a
    resumed run draws what the first one would have; streams of different purposes,
    steps or ranks do not share seeds. 31 bits: what every consumer (vLLM, torch) takes.
    """
    key = f"{job_seed}/{purpose}/{index}/{rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2**31


def free_port() -> int:
    """A port free now on this node, for rank 0 to listen on. Another process may take
    it before the rendezvous binds it; the window is small and the failure is loud."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Worker:
    """Base of a role's plain worker: one data-parallel rank. Subclasses do the work
    (load a model, compute log-probs, update) in ordinary methods; the process group
    is initialised before `__init__` runs, so the constructor may use collectives."""

    # A role whose library makes its own process group (vLLM) skips the rendezvous.
    needs_process_group = True

    def __init__(self, info: RankInfo) -> None:
        self.info = info
