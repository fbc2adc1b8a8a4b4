"""Broadcast new policy weights from the trainer to the rollout engines, bucket by bucket.

After an update the actor's rank 0 holds the full weights (`sharding.full_state_dict`)
and N rollout engines, each in its own process, need them (in both modes). They meet
in a *sync group*: rank 0 is the sender (the actor's rank 0), ranks 1..N the engines.
The group is standalone: it is built from its own `TCPStore`, hosted by the sender,
and is never registered with torch.distributed, so it neither needs nor touches the
default process group of either side (the actor ranks have one; an engine may too).
It runs gloo on CPU and NCCL on GPU, and gloo through host memory for engines that
share the sender's GPU (`sync_device`).

The weights travel in buckets (`plan_buckets`): the tensors of one dtype, in order,
packed into flat runs of at most `bucket_bytes`. Each side allocates one byte buffer
per transfer, as large as the largest bucket, and reuses it for every bucket (viewed
as the bucket's dtype): the sender copies the bucket's tensors into it and broadcasts
it; each receiver receives into it and hands (name, view) pairs to `load` (the
engine's loader) before the next bucket overwrites it. The buffer is dropped when the
transfer ends.

Peak extra memory, on each side: that one buffer, the largest bucket, which is at
most `buffer_bound` = `max(bucket_bytes, nbytes of the largest tensor)` (a tensor
larger than a bucket is sent alone), plus on a receiver whatever `load` keeps, plus
a few bytes for the spec check. The sender also holds the weights it sends, which
the caller already had. (One buffer is reused rather than one allocated per bucket
because gloo may drop its reference to a broadcast tensor on its own thread a moment
after `wait()` returns: a buffer per bucket could briefly have two alive.)

The receivers must know the names, shapes and dtypes (`WeightSpec`s) in the sender's
order. The caller passes them out of band (through Ray, say) or sends them in band
with `send_specs`/`receive_specs`. Each transfer starts by checking that every rank
has the same specs, and fails on every rank with a ValueError when they differ.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import (
    Backend,
    PrefixStore,
    ProcessGroup,
    ProcessGroupGloo,
    Store,
    TCPStore,
)

DEFAULT_BUCKET_BYTES = 256 * 2**20
SYNC_TIMEOUT = timedelta(minutes=10)  # every rank must join, and each collective end, by then
SENDER = 0  # the sync group's rank 0 sends

# What a receiver hands to the engine: the (name, tensor) views of one bucket.
Loader = Callable[[list[tuple[str, Tensor]]], None]


@dataclass(frozen=True)
class WeightSpec:
    """One tensor as the receivers must expect it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: Tensor) -> WeightSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": _dtype_name(self.dtype)}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> WeightSpec:
        name, shape, dtype = data["name"], data["shape"], data["dtype"]
        if not isinstance(name, str) or not isinstance(shape, list) or not isinstance(dtype, str):
            raise ValueError(f"not a weight spec: {data!r}")
        return cls(name, tuple(int(d) for d in shape), _dtype_from_name(dtype))


def weight_specs(weights: Mapping[str, Tensor]) -> list[WeightSpec]:
    """The specs of named tensors, in the mapping's order (the order they are sent in)."""
    return [WeightSpec.of(name, tensor) for name, tensor in weights.items()]


def plan_buckets(specs: Sequence[WeightSpec], bucket_bytes: int) -> list[list[WeightSpec]]:
    """Pack the tensors into buckets, each one flat buffer of one dtype.

    The tensors are grouped by dtype (the dtypes in order of first appearance, each
    group in the given order); within a group consecutive tensors fill a bucket until
    the next would take it over `bucket_bytes`. A tensor larger than `bucket_bytes`
    gets a bucket of its own, so every bucket holds at most
    `max(bucket_bytes, largest tensor)` bytes. Every tensor is in exactly one bucket.
    Sender and receivers call this with the same specs and get the same plan.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"weight names must be unique, repeated: {duplicates}")
    by_dtype: dict[torch.dtype, list[WeightSpec]] = {}
    for spec in specs:
        by_dtype.setdefault(spec.dtype, []).append(spec)
    buckets: list[list[WeightSpec]] = []
    for group in by_dtype.values():
        bucket: list[WeightSpec] = []
        size = 0
        for spec in group:
            if bucket and size + spec.nbytes > bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(spec)
            size += spec.nbytes
        if bucket:
            buckets.append(bucket)
    return buckets


def bucket_nbytes(bucket: Sequence[WeightSpec]) -> int:
    return sum(spec.nbytes for spec in bucket)


def buffer_bound(specs: Sequence[WeightSpec], bucket_bytes: int) -> int:
    """The most bytes one bucket buffer takes: `max(bucket_bytes, largest tensor)`,
    capped by the total (the bound on each side's extra memory, without `load`)."""
    largest = max((spec.nbytes for spec in specs), default=0)
    total = sum(spec.nbytes for spec in specs)
    return min(max(bucket_bytes, largest), total)


@dataclass(frozen=True)
class SyncStats:
    """What one transfer moved, on one rank."""

    tensors: int
    buckets: int
    bytes: int
    buffer_bytes: int  # the one bucket buffer: the extra memory of the transfer


class SyncGroup:
    """A standalone process group: the sender (rank 0) and the rollout engines.

    Built from a `TCPStore` that rank 0 hosts on `port`, never registered with
    torch.distributed: the default process group (if any) is neither used nor changed,
    and `dist.*` functions do not see this group. Collectives go through `broadcast`.
    """

    def __init__(
        self,
        process_group: ProcessGroup,
        store: Store,
        device: torch.device,
    ) -> None:
        self._pg: ProcessGroup | None = process_group
        self._store: Store | None = store
        self.device = device
        self.rank = process_group.rank()
        self.world_size = process_group.size()

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        timeout: timedelta = SYNC_TIMEOUT,
    ) -> SyncGroup:
        """Join the group; every rank calls this and it returns once all have joined.

        `host`/`port`: the sender's address; rank 0 listens there (pick the port with
        `workers.free_port`), the others connect. `device`: "cpu" gives a gloo group,
        a CUDA device an NCCL group on that device (the process's current device is
        left alone; each collective runs under `torch.cuda.device(device)`).
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        device = torch.device(device)
        tcp_store = TCPStore(
            host,
            port,
            world_size,
            is_master=rank == SENDER,
            timeout=timeout,
            wait_for_workers=False,
        )
        store = PrefixStore("weight-sync/", tcp_store)
        pg = ProcessGroup(store, rank, world_size)
        backend: Backend
        if device.type == "cpu":
            backend = ProcessGroupGloo(store, rank, world_size, timeout)
            backend_type = ProcessGroup.BackendType.GLOO
        elif device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            from torch._C._distributed_c10d import ProcessGroupNCCL  # CUDA builds only

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = ProcessGroupNCCL(store, rank, world_size, options)
            backend_type = ProcessGroup.BackendType.NCCL
        else:
            raise ValueError(f"weight sync runs on cpu (gloo) or cuda (nccl), not {device}")
        backend._set_sequence_number_for_group()
        pg._set_default_backend(backend_type)
        pg._register_backend(device, backend_type, backend)
        return cls(pg, tcp_store, device)

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER

    @property
    def process_group(self) -> ProcessGroup:
        if self._pg is None:
            raise RuntimeError("the sync group is closed")
        return self._pg

    def broadcast(self, tensor: Tensor) -> None:
        """Broadcast `tensor` (on this group's device) from the sender, in place."""
        if tensor.device != self.device:
            raise ValueError(f"tensor on {tensor.device}, the group runs on {self.device}")
        with _on_device(self.device):
            self.process_group.broadcast(tensor, SENDER).wait()

    def all_agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (a logical AND over the group)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        with _on_device(self.device):
            self.process_group.allreduce(flag, dist.ReduceOp.MIN).wait()
        return bool(flag.item())

    def close(self) -> None:
        """Leave the group and release its connections; idempotent."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            pg.shutdown()

    def __enter__(self) -> SyncGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def sync_device(transport: str) -> torch.device:
    """The device a rank's side of the group runs on: "host" is memory (gloo), for an
    engine that shares the sender's GPU, where NCCL refuses two ranks on one device;
    "accelerator" is this process's GPU (NCCL) when it has one, else memory (gloo)."""
    if transport not in ("host", "accelerator"):
        raise ValueError(f"weight-sync transport is 'host' or 'accelerator', not {transport!r}")
    if transport == "host" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def open_sync_group(
    host: str, port: int, rank: int, world_size: int, transport: str, timeout_s: float
) -> SyncGroup:
    """Join the weight-sync group over `transport` (see `sync_device`); its collectives
    wait at most `timeout_s`."""
    wait = timedelta(seconds=timeout_s)
    return SyncGroup.create(host, port, rank, world_size, sync_device(transport), wait)


def send_specs(group: SyncGroup, specs: Sequence[WeightSpec]) -> None:
    """Send the specs in band (sender side of `receive_specs`): a length, then JSON."""
    _require(group, sender=True)
    payload = json.dumps([spec.to_json() for spec in specs]).encode()
    group.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=group.device))
    group.broadcast(torch.tensor(list(payload), dtype=torch.uint8, device=group.device))


def receive_specs(group: SyncGroup) -> list[WeightSpec]:
    """Receive the specs the sender passes to `send_specs`."""
    _require(group, sender=False)
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(length)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(payload)
    data = json.loads(bytes(payload.cpu().tolist()).decode())
    return [WeightSpec.from_json(item) for item in data]


def send_weights(
    group: SyncGroup,
    weights: Mapping[str, Tensor],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> SyncStats:
    """Broadcast `weights` (on any device) to the receivers; the sender's side of
    `receive_weights`, with the same `bucket_bytes`. Extra memory: one buffer on the
    group's device, the largest bucket, at most `buffer_bound(weight_specs(weights), ...)`."""
    _require(group, sender=True)
    specs = weight_specs(weights)
    _check_same_specs(group, specs)
    plan = plan_buckets(specs, bucket_bytes)
    buffer = _allocate(_largest_bucket(plan), group.device)
    for bucket in plan:
        flat = _bucket_view(buffer, bucket)
        offset = 0
        for spec in bucket:
            # copy_ through a view: a strided or CPU tensor goes in without a temporary.
            flat[offset : offset + spec.numel].view(spec.shape).copy_(weights[spec.name])
            offset += spec.numel
        _broadcast_bucket(group, buffer, bucket)
    return _stats(specs, plan, buffer)


def receive_weights(
    group: SyncGroup,
    specs: Sequence[WeightSpec],
    bucket_bytes: int,
    load: Loader,
) -> SyncStats:
    """Receive the weights the sender passes to `send_weights` (same `bucket_bytes`),
    described by `specs` in the sender's order.

    For each bucket, in plan order, `load` is called once with (name, view) pairs into
    the transfer's buffer, on the group's device. The views are valid only during the
    call (the next bucket overwrites them): `load` must copy what it keeps, as an
    engine's `load_weights` copies into its parameters. Extra memory: one buffer, the
    largest bucket, at most `buffer_bound(specs, bucket_bytes)`, plus what `load` keeps.
    """
    _require(group, sender=False)
    _check_same_specs(group, specs)
    plan = plan_buckets(specs, bucket_bytes)
    buffer = _allocate(_largest_bucket(plan), group.device)
    for bucket in plan:
        _broadcast_bucket(group, buffer, bucket)
        flat = _bucket_view(buffer, bucket)
        views: list[tuple[str, Tensor]] = []
        offset = 0
        for spec in bucket:
            views.append((spec.name, flat[offset : offset + spec.numel].view(spec.shape)))
            offset += spec.numel
        load(views)
        del views
    return _stats(specs, plan, buffer)


def receive_copies(
    group: SyncGroup, specs: Sequence[WeightSpec], bucket_bytes: int
) -> list[tuple[str, Tensor]]:
    """`receive_weights` into a copy of every tensor, for a receiver that loads them in
    one go afterwards (it holds one full copy meanwhile)."""
    received: list[tuple[str, Tensor]] = []
    receive_weights(
        group,
        specs,
        bucket_bytes,
        lambda bucket: received.extend((n, t.clone()) for n, t in bucket),
    )
    return received


def specs_digest(specs: Sequence[WeightSpec]) -> bytes:
    """A fingerprint of the specs, order included (32 bytes)."""
    payload = json.dumps([spec.to_json() for spec in specs]).encode()
    return hashlib.sha256(payload).digest()


def _check_same_specs(group: SyncGroup, specs: Sequence[WeightSpec]) -> None:
    """The sender broadcasts its specs' digest; all ranks fail together on a mismatch
    (a receiver alone failing would leave the others blocked in the next broadcast)."""
    digest = torch.tensor(list(specs_digest(specs)), dtype=torch.uint8, device=group.device)
    received = digest.clone()
    group.broadcast(received)
    if not group.all_agree(torch.equal(received, digest)):
        raise ValueError(
            "the sync group's ranks disagree on the weight specs (names, shapes, dtypes "
            "or order): every receiver must pass the sender's specs in the sender's order"
        )


def _require(group: SyncGroup, *, sender: bool) -> None:
    if group.is_sender != sender:
        role = "the sender (rank 0)" if sender else "a receiver (rank > 0)"
        raise ValueError(f"only {role} may call this; this is rank {group.rank}")


def _allocate(nbytes: int, device: torch.device) -> Tensor:
    """The transfer's one buffer, in bytes (one place, so a test can watch it)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _largest_bucket(plan: Sequence[Sequence[WeightSpec]]) -> int:
    return max((bucket_nbytes(bucket) for bucket in plan), default=0)


def _bucket_view(buffer: Tensor, bucket: Sequence[WeightSpec]) -> Tensor:
    """The start of the byte buffer as one flat tensor of the bucket's dtype."""
    return buffer[: bucket_nbytes(bucket)].view(bucket[0].dtype)


def _broadcast_bucket(group: SyncGroup, buffer: Tensor, bucket: Sequence[WeightSpec]) -> None:
    nbytes = bucket_nbytes(bucket)
    if nbytes:  # a bucket of empty tensors sends nothing, on every rank alike
        group.broadcast(buffer[:nbytes])


def _stats(specs: Sequence[WeightSpec], plan: Sequence[object], buffer: Tensor) -> SyncStats:
    return SyncStats(len(specs), len(plan), sum(s.nbytes for s in specs), buffer.nbytes)


def _on_device(device: torch.device) -> AbstractContextManager[object]:
    """NCCL runs on the current CUDA device: make it the group's for one collective."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype
