"""Which weight transfer a job takes from the actor to its rollout engines, decided once
from its spec (`choose_transfer`), and the NCCL group's ranks (`nccl_ranks`). Pure: no
torch, no Ray, no vLLM; the trainer hands the decision to both sides of the transfer
(the engines are built with it: vLLM's `weight_transfer_config`; the actor takes it
from them) and the docs' table (docs/concepts/modes.md) says the same.

    rlhf_host  the actor's or the rollout's pool computes on CPU (`device: cpu`, or no
               CUDA): this project's host transfer (shared memory, gloo between nodes)
    ipc        every GPU of every engine also holds an actor rank (the same pool: both
               roles take all of its GPUs): vLLM's CUDA IPC, no copy
    nccl       any other GPU placement: vLLM's NCCL broadcast from actor rank 0

One backend per job: vLLM's trainer side is one engine of one backend, driving every
rollout engine with the same calls, so a job whose engines would want different
backends (some beside the actor, some not) takes NCCL for all of them. vLLM's IPC
engine serves a worker only from a handle made on that worker's own GPU
(`ipc_engine.py`: handles keyed by GPU UUID, all-gathered over the actor's ranks),
which is why IPC needs an actor rank on every engine GPU.

Every placement the planner accepts is served: CPU by the host transfer, GPU by NCCL
in general and IPC where it applies. No admission rule is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rlhf_trainer.api.config import Device, JobConfig, Role
from rlhf_trainer.api.plan import PlacementPlan, RolePlan, plan_placement


class Backend(StrEnum):
    """vLLM's name of each weight-transfer backend (`weight_transfer_config.backend`)."""

    NCCL = "nccl"
    IPC = "ipc"
    HOST = "rlhf_host"  # this project's (rollout.transfer_engines), for CPUs


@dataclass(frozen=True)
class NcclRanks:
    """The NCCL group of a transfer: the sender (actor rank 0) is rank 0, then each
    engine's vLLM workers, engine after engine."""

    world_size: int  # 1 + engines x workers per engine (TP x PP)
    rank_offsets: tuple[int, ...]  # per engine: the rank of its first worker


def nccl_ranks(engines: int, workers_per_engine: int, first: int = 1) -> NcclRanks:
    """Ranks for `engines` separate vLLM engines of `workers_per_engine` workers each,
    the first at `first` (after the sender). vLLM ranks a worker
    `data_parallel_index x (TP x PP) + rank + rank_offset`, and each of our engines is
    its own vLLM instance (data-parallel index 0): without an offset of its own every
    engine would claim the same ranks."""
    if engines < 1 or workers_per_engine < 1:
        raise ValueError(
            f"a transfer needs at least one engine of one worker, got {engines} engine(s) "
            f"of {workers_per_engine} worker(s)"
        )
    offsets = tuple(first + engine * workers_per_engine for engine in range(engines))
    return NcclRanks(first + engines * workers_per_engine, offsets)


@dataclass(frozen=True)
class TransferPlan:
    """A job's weight transfer: the backend, why, and the NCCL group of its engines
    as planned (used by `nccl` only; an engine lost or joined regroups them)."""

    backend: Backend
    why: str
    ranks: NcclRanks


def choose_transfer(config: JobConfig, cuda: bool) -> TransferPlan:
    """The job's weight transfer. `cuda`: whether its GPU pools have CUDA (false on a
    CPU machine, where a local run's logical GPUs are cores)."""
    plan = plan_placement(config)
    actor, rollout = plan.roles[Role.ACTOR], plan.roles[Role.ROLLOUT]
    tp = rollout.tensor_parallel_size
    ranks = nccl_ranks(rollout.data_parallel_size, tp)
    cpu_pools = sorted(
        {p for p in (actor.pool, rollout.pool) if config.pool(p).device is Device.CPU}
    )
    if not cuda or cpu_pools:
        where = f"pool {', '.join(cpu_pools)} has device: cpu" if cpu_pools else "no CUDA"
        return TransferPlan(Backend.HOST, f"{where}: the host transfer", ranks)
    if engine_gpus(plan) <= actor_gpus(plan):
        why = "every engine GPU holds an actor rank: CUDA IPC, no copy"
        return TransferPlan(Backend.IPC, why, ranks)
    why = f"engines on GPUs without an actor rank: NCCL broadcast to {ranks.world_size - 1}"
    return TransferPlan(Backend.NCCL, why + " worker(s)", ranks)


Gpu = tuple[str, int]  # (pool, index among its GPUs): node index // gpusPerNode


def actor_gpus(plan: PlacementPlan) -> set[Gpu]:
    """The GPUs of the actor's ranks: one rank on each GPU of its pool."""
    return _gpus(plan.roles[Role.ACTOR])


def engine_gpus(plan: PlacementPlan) -> set[Gpu]:
    """The GPUs of every engine's workers: engine e's TP workers on GPUs e*TP … e*TP+TP-1
    of the rollout pool (a node's GPUs: TP divides gpusPerNode)."""
    return _gpus(plan.roles[Role.ROLLOUT])


def _gpus(role: RolePlan) -> set[Gpu]:
    return {(role.pool, gpu) for gpu in range(role.data_parallel_size * role.tensor_parallel_size)}
