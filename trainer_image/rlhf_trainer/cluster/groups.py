"""Worker groups: the data-parallel ranks of one role on one pool.

A role's work lives in a plain Python class (`rlhf_trainer.worker.Worker`). Ray stays
at the edge: `RankHost` (`cluster.rank_host`) is the one actor class, hosting one rank's
worker (and the same rank of the roles that live in the actor's processes,
`WorkerGroup.beside`), and `WorkerGroup` owns the hosts of a role: it places them on the
pool's bundles, runs the rank-0 rendezvous, shards batches over the ranks, fans calls out
and gathers the results.

Calls return futures (Ray `ObjectRef`s), so the PPO loop issues the calls of different
pools together and joins them when it needs the results: that is split placement.

A rank runs its calls one at a time, in order, on one thread. Every rank also answers
on a second thread (the TELEMETRY concurrency group), while it is busy in a call:
`alive` (who did not answer, `cluster.hangs`), `drain_calls` (the timeline) and, for an
engine, `engine_stats` (see `cluster.engine_stats`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import PlacementPlan
from rlhf_trainer.cluster.hangs import (
    LOST_AFTER_S,
    TELEMETRY,
    RankCall,
    RanksLost,
    answering,
    record,
)
from rlhf_trainer.cluster.placement import PoolGroup, WorkerSlot, engine_environment, role_slots
from rlhf_trainer.cluster.rank_host import RankHost, Whereabouts, WorkerClass
from rlhf_trainer.cluster.waits import Streams, join
from rlhf_trainer.telemetry.engine_stats import EngineStats
from rlhf_trainer.worker import BatchT, RankInfo, split_batch

if TYPE_CHECKING:
    from ray import ObjectRef as ObjectRef  # re-exported: the futures the loop holds

T = TypeVar("T")


SHUTDOWN_GRACE_S = 30.0
WATCH_S = 5.0  # how often a wait on what ranks produce checks that they live


class WorkerGroup:
    """The data-parallel ranks of one role, placed on its pool's bundles.

    `run` and `run_sharded` return one future per rank, in rank order; `gather` joins
    them. Nothing here blocks on the work itself, so groups on different pools run at
    the same time when their calls are issued together.
    """

    # Ray's annotations do not cover calling actor methods (`handle.method.remote`), so
    # the actor handles are Any; the methods they run are RankHost's, which are typed.
    def __init__(
        self,
        role: Role,
        slots: Sequence[WorkerSlot],
        hosts: Sequence[Any],
        ready: Sequence[ObjectRef[None]],
        ranks: Sequence[int] | None = None,
        owns_hosts: bool = True,
    ) -> None:
        self.role = role
        self.slots = tuple(slots)
        self.hosts = tuple(hosts)
        self.ready = list(ready)  # one per rank: done once its worker is built
        # Each worker's own rank (RankInfo.rank), by position: 0 … n-1 until the group
        # loses some (`without`); what errors and logs name them by.
        self.ranks = tuple(range(len(self.hosts)) if ranks is None else ranks)
        # False: the hosts are another role's, whose group ends them (`beside`)
        self.owns_hosts = owns_hosts

    def joined(self, other: WorkerGroup) -> WorkerGroup:
        """This group with `other`'s ranks (started since, and ready), in rank order."""
        ranks, slots, hosts = (self.ranks + other.ranks, self.slots + other.slots,
                               self.hosts + other.hosts)  # fmt: skip
        order = sorted(range(len(ranks)), key=lambda i: ranks[i])
        return self._of([slots[i] for i in order], [hosts[i] for i in order],
                        [ranks[i] for i in order])  # fmt: skip

    def without(self, ranks: Sequence[int]) -> WorkerGroup:
        """The group less the workers of `ranks` (their own ranks): what goes on when
        those are lost."""
        kept = [i for i, rank in enumerate(self.ranks) if rank not in ranks]
        return self._of([self.slots[i] for i in kept], [self.hosts[i] for i in kept],
                        [self.ranks[i] for i in kept])  # fmt: skip

    def slots_of(self, ranks: Sequence[int]) -> list[WorkerSlot]:
        """The slots of the workers of `ranks` (their own ranks), in that order."""
        return [self.slots[self.ranks.index(rank)] for rank in ranks]

    def substituted(self, new: WorkerGroup) -> WorkerGroup:
        """This group with the ranks of `new` in place of those in the same slots (ranks
        replaced in their bundles): each takes the place, and so the part of a batch,
        of the one it replaces."""
        taking = dict(zip(new.slots, zip(new.hosts, new.ranks, strict=True), strict=True))
        mine = zip(self.slots, self.hosts, self.ranks, strict=True)
        kept = [taking.get(slot, (host, rank)) for slot, host, rank in mine]
        return self._of(list(self.slots), [host for host, _ in kept], [rank for _, rank in kept])

    def _of(self, slots: list[WorkerSlot], hosts: list[Any], ranks: list[int]) -> WorkerGroup:
        # Ranks that started already: no futures of their start to keep.
        return WorkerGroup(self.role, slots, hosts, [], ranks, self.owns_hosts)

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def pool(self) -> str:
        return self.slots[0].pool

    @classmethod
    def spawn(
        cls,
        plan: PlacementPlan,
        role: Role,
        pool_group: PoolGroup,
        worker_cls: WorkerClass,
        *args: Any,
        **kwargs: Any,
    ) -> WorkerGroup:
        """Start the role's ranks on its pool and have them rendezvous and build their
        workers. Returns at once, without waiting for the ranks to be placed or built,
        so the groups of several roles start together; `ray.get(group.ready)` joins
        them. Calls issued before then queue behind the build (an actor runs its calls
        in order)."""
        slots = role_slots(plan, role, pool_group.rank_order)
        ranks = range(len(slots))
        return cls.spawn_ranks(role, slots, ranks, pool_group, worker_cls, *args, **kwargs)

    @classmethod
    def spawn_ranks(
        cls,
        role: Role,
        slots: Sequence[WorkerSlot],
        ranks: Sequence[int],
        pool_group: PoolGroup,
        worker_cls: WorkerClass,
        *args: Any,
        **kwargs: Any,
    ) -> WorkerGroup:
        """`spawn`, for the ranks `ranks` in `slots` of `pool_group` (ranks that join a
        running role need no process group: rollout engines)."""
        import ray

        # A thread that answers beside a call. Ray then runs the calls on a thread of
        # their own too, not the main one: still one at a time, in order.
        remote: Any = ray.remote(concurrency_groups={TELEMETRY: 1})  # type: ignore[call-overload]
        remote_host = remote(RankHost)
        hosts = [
            remote_host.options(
                # CPU is not what limits a pool's workers; asking for none keeps a
                # GPU-only bundle enough (see placement.gpu_bundle).
                num_cpus=0,
                num_gpus=slot.process_gpus,
                scheduling_strategy=pool_group.scheduling(slot),
            ).remote(
                RankInfo(role, slot.pool, rank, len(slots)),
                worker_cls,
                args,
                kwargs,
                engine_environment(slot),
            )
            for rank, slot in zip(ranks, slots, strict=True)
        ]
        # Rank 0's address is passed on as a future: each rank's setup starts once it is
        # known, and nothing here waits for a rank to be placed. So the roles on
        # different nodes start (import, load) together, not one role after another; and
        # an engine respawned into a bundle whose node is being replaced blocks nothing.
        needs_rendezvous = worker_cls.needs_process_group
        rendezvous = hosts[0].rendezvous_address.remote() if needs_rendezvous else None
        # All ranks at once: init_process_group blocks until the whole group has joined.
        ready = [h.setup.remote(rendezvous) for h in hosts]
        for rank, slot, host, ref in zip(ranks, slots, hosts, ready, strict=True):
            record(ref, RankCall(role, slot.pool, rank, "setup", host))  # named if it fails
        return cls(role, slots, hosts, ready, ranks)

    @classmethod
    def beside(
        cls, hosting: WorkerGroup, role: Role, worker_cls: WorkerClass, *args: Any, **kwargs: Any
    ) -> WorkerGroup:
        """`role`'s ranks in the processes of `hosting`'s, rank for rank: each builds its
        worker once the host's own is built (a host runs its calls in order), in the
        host's process group (`plan.in_actor_processes`). Returns at once, as `spawn`."""
        world = hosting.world_size
        ready = []
        for rank, slot, host in zip(hosting.ranks, hosting.slots, hosting.hosts, strict=True):
            info = RankInfo(role, slot.pool, rank, world)
            ready.append(host.host_beside.remote(info, worker_cls, args, kwargs))
            record(ready[-1], RankCall(role, slot.pool, rank, "setup", host))
        return cls(role, hosting.slots, hosting.hosts, ready, hosting.ranks, owns_hosts=False)

    def run(
        self,
        method: str,
        *args: Any,
        after: Sequence[ObjectRef[Any]] | None = None,
        phase: str | None = None,
        **kwargs: Any,
    ) -> list[ObjectRef[Any]]:
        """Call `method` with the same arguments on every rank."""
        return self._issue(method, [args] * self.world_size, kwargs, after, phase)

    def run_sharded(
        self,
        method: str,
        batch: BatchT,
        *args: Any,
        after: Sequence[ObjectRef[Any]] | None = None,
        phase: str | None = None,
        **kwargs: Any,
    ) -> list[ObjectRef[Any]]:
        """Call `method` on every rank with its shard of `batch` as first argument.

        `after`: one future per rank that the rank's call waits for (a call of another
        role on the same GPUs, so colocated roles take turns instead of overlapping).
        `phase`: the step phase the call is, for the timeline.
        """
        shards = [own_storage(s) for s in split_batch(batch, self.world_size)]
        return self.run_each(method, shards, *args, after=after, phase=phase, **kwargs)

    def run_each(
        self,
        method: str,
        firsts: Sequence[Any],
        *args: Any,
        after: Sequence[ObjectRef[Any]] | None = None,
        phase: str | None = None,
        **kwargs: Any,
    ) -> list[ObjectRef[Any]]:
        """Call `method` on every rank, rank i with firsts[i] as first argument."""
        return self._issue(method, [(first, *args) for first in firsts], kwargs, after, phase)

    def stream_each(
        self, method: str, firsts: Sequence[Any], *args: Any, phase: str | None = None
    ) -> Streams:
        """Like `run_each`, for a worker method that yields its results as they come;
        `results_as_they_come` reads them."""
        calls = [RankCall(self.role, self.pool, rank, method, h)
                 for rank, h in zip(self.ranks, self.hosts, strict=True)]  # fmt: skip
        generators = [
            h.stream.remote(method, first, *args, worker_role=self.role, phase=phase)
            for h, first in zip(self.hosts, firsts, strict=True)
        ]
        return Streams(calls, generators)

    def _issue(
        self,
        method: str,
        rank_args: Sequence[tuple[Any, ...]],
        kwargs: dict[str, Any],
        after: Sequence[ObjectRef[Any]] | None,
        phase: str | None,
    ) -> list[ObjectRef[Any]]:
        waits = [[ref] for ref in after] if after is not None else [[]] * self.world_size
        if len(waits) != self.world_size or len(rank_args) != self.world_size:
            raise ValueError(
                f"{self.role} has {self.world_size} ranks: got {len(rank_args)} argument "
                f"lists and {len(waits)} calls to wait for"
            )
        refs = [
            h.call.remote(method, *a, worker_role=self.role, after=wait, phase=phase, **kwargs)
            for h, a, wait in zip(self.hosts, rank_args, waits, strict=True)
        ]
        for rank, ref, host in zip(self.ranks, refs, self.hosts, strict=True):
            record(ref, RankCall(self.role, self.pool, rank, method, host))
        return refs

    def drain_calls(self) -> list[ObjectRef[list[tuple[str, float, float]]]]:
        """Per rank, a future of the calls it ran since the last drain (see
        RankHost.drain_calls); a rank busy in a call answers beside it."""
        telemetry = [h.drain_calls.options(concurrency_group=TELEMETRY) for h in self.hosts]
        return [drain.remote(self.role) for drain in telemetry]

    def engine_stats(self, rank: int) -> ObjectRef[EngineStats | None]:
        """Ask rank `rank` for its engine's stats; it answers even while busy in a call."""
        host = self.hosts[rank]
        stats: ObjectRef[EngineStats | None]
        stats = host.engine_stats.options(concurrency_group=TELEMETRY).remote()
        return stats

    def whereabouts(self) -> list[Whereabouts]:
        import ray

        return list(ray.get([h.whereabouts.remote() for h in self.hosts]))

    def dead_ranks(self) -> list[int]:
        """The ranks that Ray finds dead (killed, or on a lost node), or that do not
        answer a ping for LOST_AFTER_S (stopped). Quick while all answer."""
        ranks = zip(self.ranks, self.hosts, strict=True)
        calls = [RankCall(self.role, self.pool, rank, "alive", host) for rank, host in ranks]
        up = answering(calls, within_s=LOST_AFTER_S)
        return [call.rank for call, answered in zip(calls, up, strict=True) if not answered]

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """End the actors, cleanly if they answer within `grace_s`; the placement groups
        stay. After a failure some ranks may be dead or stuck in a collective: they
        are killed all the same, and the error that caused it is not hidden. A group
        hosted `beside` another role's leaves that to the hosting group."""
        import ray

        if not self.owns_hosts:
            return
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get([h.shutdown.remote() for h in self.hosts], timeout=grace_s)
        for h in self.hosts:
            ray.kill(h)


def own_storage(shard: BatchT) -> BatchT:
    """`shard` in tensors of its own. `split_batch` cuts views of the whole batch, and
    a pickled view (a Ray call's argument) carries the whole storage under it: each rank
    would be sent, and would unpickle, every rank's rows. The same values, copied."""
    if isinstance(shard, Tensor):
        return _owned(shard)
    return replace(shard, **{name: _owned(t) for name, t in shard.tensors().items()})


def _owned(tensor: Tensor) -> Tensor:
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone()


def started_up(groups: Sequence[WorkerGroup], timeout_s: float) -> WorkerGroup:
    """The ranks of `groups` (started in the background) as one group, once all are up;
    NoAnswer past `timeout_s`, naming those not up, or RankDied naming one whose start
    failed."""
    join([ref for group in groups for ref in group.ready], timeout_s)
    return functools.reduce(WorkerGroup.joined, groups)


def join_watching(ref: ObjectRef[T], group: WorkerGroup, every_s: float = WATCH_S) -> T:
    """Wait for one future that `group`'s ranks work towards without being called (a
    queue that they fill): every `every_s`, check that they live. Dead ones raise
    RanksLost at once instead of leaving the wait to its own timeout."""
    import ray

    while not ray.wait([ref], timeout=every_s)[0]:
        if dead := group.dead_ranks():
            raise RanksLost(group.role, group.pool, dead)
    return join([ref])[0]
