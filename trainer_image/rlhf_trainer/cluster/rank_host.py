"""The Ray actor that hosts one rank: its worker, and the same rank's workers of the
roles that live in its process (`RankHost.host_beside`). The only code that asks Ray
where it is; `cluster.groups` places these actors and fans calls out to them.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlhf_trainer.api.config import Role
from rlhf_trainer.telemetry.engine_stats import EngineStats
from rlhf_trainer.worker import CPU_THREADS_PER_RANK, RankInfo, Worker, free_port, init_distributed

if TYPE_CHECKING:
    from ray import ObjectRef


@dataclass(frozen=True)
class WorkerPath:
    """A worker class named by its module, imported only in its ranks' processes: a
    role's module imports what the role runs (transformers, peft, vLLM), which the
    driver that starts the ranks never does. `needs_process_group` repeats the class's
    own, since the driver reads it before any rank starts; `load` checks they agree."""

    module: str
    name: str
    needs_process_group: bool = True

    def load(self) -> type[Worker]:
        worker_cls: type[Worker] = getattr(importlib.import_module(self.module), self.name)
        if worker_cls.needs_process_group != self.needs_process_group:
            raise TypeError(
                f"{self.module}.{self.name}.needs_process_group is "
                f"{worker_cls.needs_process_group}, but its WorkerPath says otherwise"
            )
        return worker_cls


# A worker class as the driver hands it to a rank: named (the product's roles), or the
# class itself (a test's, which the driver may import).
WorkerClass = type[Worker] | WorkerPath


def load_worker(worker: WorkerClass) -> type[Worker]:
    return worker.load() if isinstance(worker, WorkerPath) else worker


@dataclass(frozen=True)
class Whereabouts:
    """Where a rank actually runs, as Ray sees it."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]  # the GPUs Ray assigned (shared by colocated roles)
    pid: int  # the rank's process on that node


class RankHost:
    """The Ray actor around one rank's worker (and the same rank's workers of the roles
    hosted beside it, `host_beside`): the only code that asks Ray where it is.

    Constructed first, then `setup` joins the process group and builds the worker, since
    rank 0's address is known only once rank 0 is placed.
    """

    def __init__(
        self,
        info: RankInfo,
        worker_cls: WorkerClass,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        environment: dict[str, str] | None = None,
    ) -> None:
        self.info = info
        self._build = (worker_cls, args, kwargs)
        self.environment = environment or {}  # set before the worker is built
        # by role: this rank's own worker, and those hosted beside it (`host_beside`)
        self.workers: dict[Role, Worker] = {}
        self.calls: list[tuple[Role, str, float, float]] = []  # (role, phase, start, end)
        self.calls_lock = threading.Lock()  # calls are timed on one thread, drained on another

    def __repr__(self) -> str:
        """What Ray names this actor by in its logs (a worker's log file, the driver's
        log prefix): the role and rank it hosts, not the class alone."""
        return f"RankHost({self.info.role.value} rank {self.info.rank})"

    @property
    def worker(self) -> Worker | None:
        """This rank's own worker (its role's), once built."""
        return self.workers.get(self.info.role)

    def whereabouts(self) -> Whereabouts:
        import ray

        context = ray.get_runtime_context()
        return Whereabouts(
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            gpu_ids=tuple(context.get_accelerator_ids().get("GPU", [])),
            pid=os.getpid(),
        )

    def rendezvous_address(self) -> tuple[str, int]:
        return self.whereabouts().node_ip, free_port()

    def setup(self, rendezvous: tuple[str, int] | None) -> None:
        """Import the worker's class (after the placement's environment is set: vLLM
        reads it), join the role's process group at rank 0's `rendezvous` (None: the
        worker needs none), then build the worker."""
        named, args, kwargs = self._build
        if self.environment:
            self._set_environment()
        if not torch.cuda.is_available():
            # On a CPU machine a "GPU" stands for a core: a rank computing on many
            # threads would slow the ranks of other pools that run at the same time.
            torch.set_num_threads(CPU_THREADS_PER_RANK)
        worker_cls = load_worker(named)  # before the rendezvous: a failed import waits for no one
        if rendezvous is not None:
            init_distributed(self.info, *rendezvous)
        self.workers[self.info.role] = worker_cls(self.info, *args, **kwargs)

    def _set_environment(self) -> None:
        """The placement's environment for this rank's worker (`engine_environment`),
        and the cluster's address: a tensor-parallel engine's core is a child process
        that joins this Ray cluster to start its workers, and a child of a Ray worker
        is not told where the cluster is (OpenRLHF sets it for the same reason)."""
        import ray

        os.environ.update(self.environment)
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)

    def host_beside(
        self,
        info: RankInfo,
        worker_cls: WorkerClass,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Build another role's worker in this process, after this rank's own: the same
        rank of a role on the same GPUs, in the same process group (`plan.in_actor_processes`)."""
        if self.worker is None:
            raise RuntimeError(
                f"{info.role} rank {info.rank} cannot start beside {self.info.role} rank "
                f"{self.info.rank}: that rank's setup failed (the error is in its `ready`)"
            )
        self.workers[info.role] = load_worker(worker_cls)(info, *args, **kwargs)

    def call(
        self,
        method: str,
        *args: Any,
        worker_role: Role | None = None,
        after: Sequence[ObjectRef[Any]] = (),
        phase: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run `method` of the worker of `worker_role` (this rank's own if None), once
        the calls in `after` (another role's on this GPU) are done; it raises what they
        raised. They come in a list, which Ray does not resolve before sending the call:
        its arguments travel while the other role computes, and it starts without a
        round trip through the driver. `phase` names the call on the timeline (the
        method's name if not given)."""
        role, worker = self._worker_of(worker_role)
        if after:
            import ray

            ray.get(list(after))
        start = time.time()
        try:
            return getattr(worker, method)(*args, **kwargs)
        finally:
            self._timed(role, phase or method, start)

    def stream(
        self, method: str, *args: Any, worker_role: Role | None = None, phase: str | None = None
    ) -> Iterator[Any]:
        """Like `call`, for a worker method that yields its results as they come: the
        driver gets each as it is yielded (a Ray streaming call)."""
        role, worker = self._worker_of(worker_role)
        start = time.time()
        try:
            yield from getattr(worker, method)(*args)
        finally:
            self._timed(role, phase or method, start)

    def _worker_of(self, role: Role | None) -> tuple[Role, Worker]:
        """The worker of `role` (this rank's own if None)."""
        role = role or self.info.role
        worker = self.workers.get(role)
        if worker is None:
            raise RuntimeError(
                f"{role} rank {self.info.rank} has no worker: its setup failed "
                "(the error is in WorkerGroup.ready)"
            )
        return role, worker

    def _timed(self, role: Role, phase: str, start: float) -> None:
        with self.calls_lock:
            self.calls.append((role, phase, start, time.time()))

    def drain_calls(self, role: Role | None = None) -> list[tuple[str, float, float]]:
        """The calls of `role`'s worker (this rank's own if None) timed since the last
        drain: what the timeline shows of this rank, with what the worker did in the
        background, if it says (`drain_activity`). Runs in the TELEMETRY group: a rank
        still in a call (an engine loading weights) answers at once, and the next drain
        has that call."""
        role = role or self.info.role
        with self.calls_lock:
            calls = [(phase, start, end) for who, phase, start, end in self.calls if who == role]
            self.calls = [call for call in self.calls if call[0] != role]
        background = getattr(self.workers.get(role), "drain_activity", None)
        return calls + (background() if background is not None else [])

    def alive(self) -> bool:
        """Answers at once, in the TELEMETRY group: this rank's process runs."""
        return True

    def engine_stats(self) -> EngineStats | None:
        """The stats of the worker's engine (None before it is built). Runs in the
        TELEMETRY group, beside a call in progress: it must not touch the engine."""
        read = getattr(self.worker, "engine_stats", None)
        return read() if read is not None else None

    def shutdown(self) -> None:
        for worker in self.workers.values():
            close = getattr(worker, "close", None)
            if close is not None:
                close()  # e.g. stop vLLM's engine processes
        if dist.is_initialized():
            dist.destroy_process_group()
