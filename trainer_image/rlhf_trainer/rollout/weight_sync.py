"""The data plane of the `host` weight transfer (`transfer_engines`): how new policy
weights move from the actor's rank 0 into the rollout engines on CPU machines.

    actor rank 0 ─copy─▶ ring (shared memory) ─copy─▶ vLLM worker of an engine on its node
                          │
                          └─gloo─▶ ring of an engine on another node ─copy─▶ its vLLM worker

The weights travel in buckets (`plan_buckets`): whole layers, packed in order into
flat byte runs of at most `bucket_bytes` (a layer larger than that is a bucket of its
own). Whole layers, because vLLM's layerwise reload keeps a layer's tensors until the
layer is complete: a bucket never leaves a layer half loaded for the next one to
overwrite.

The sender's ring is a shared-memory segment of `RING_SLOTS` slots, each as large as
the largest bucket; bucket k goes to slot k % RING_SLOTS. An engine on the sender's
node reads its bucket straight from there, so each byte is copied twice: into the
ring, and from the ring into the engine's parameters. An engine on another node
(another pod: /dev/shm is per pod) receives each bucket over a gloo group into a ring
of its own, at the same offset, and its vLLM worker reads it there.

Each bucket is described by a `Bucket` (the segment and offset to read, and each
tensor's name, dtype, shape and offset in the bucket): that is the `update_info` that
travels through vLLM's `update_weights`.

Peak extra memory: on the sender, its ring (RING_SLOTS x the largest bucket); on an
engine on another node, the same; on every engine, whatever vLLM's loader keeps, and
with restarts allowed one copy of the model (`WeightStore`).
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch._C._distributed_c10d import (
    PrefixStore,
    ProcessGroup,
    ProcessGroupGloo,
    Store,
    TCPStore,
)

DEFAULT_BUCKET_BYTES = 256 * 2**20
RING_SLOTS = 2  # the sender fills one slot while the engines read the other
ALIGN = 64  # bytes: each tensor of a bucket starts on a cache line
SHM_DIR = Path("/dev/shm")
SENDER = 0  # the gloo group's rank 0 sends
HOST_TRANSFER = "rlhf_host"  # the name of this transfer among vLLM's (transfer_engines)


def transfer_backend(on_gpu: bool, beside_actor: bool) -> str:
    """vLLM's weight-transfer backend for engines on GPUs (`beside_actor`: on the
    actor's own GPUs: CUDA IPC; else NCCL) or on CPUs (this module's)."""
    if not on_gpu:
        return HOST_TRANSFER
    return "ipc" if beside_actor else "nccl"


@dataclass(frozen=True)
class TransferSetup:
    """What the driver tells the actor's ranks about a job's weight transfer: the
    sender's address (for the backends that rendezvous), how many engines, and which
    of them run on other nodes than the sender (the host transfer reaches those over
    gloo). `timeout_s`: how long a collective of the transfer may wait."""

    address: str
    port: int
    engines: int
    remote_engines: tuple[int, ...]
    bucket_bytes: int
    timeout_s: float


class TransferError(RuntimeError):
    """A weight transfer could not start or go on; the message says which and why."""


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


def weight_specs(weights: Mapping[str, Tensor]) -> list[WeightSpec]:
    """The specs of named tensors, in the mapping's order (the order they are sent in)."""
    return [WeightSpec.of(name, tensor) for name, tensor in weights.items()]


@dataclass(frozen=True)
class Bucket:
    """One bucket as an engine reads it: `segment` at `offset` holds the tensors, each
    at its `offsets` entry (bytes from `offset`). `stored_at` is the bucket's place in
    a copy of the whole model (`WeightStore`), `model_bytes` that copy's size. Travels
    as a plain dict (vLLM's `update_info`)."""

    segment: str
    offset: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: int
    stored_at: int = 0
    model_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Bucket:
        try:
            return cls(**data)
        except TypeError as error:
            raise TransferError(f"not a weight bucket: {sorted(data)} ({error})") from error

    def at(self, segment: str, offset: int) -> Bucket:
        """The same bucket, read from elsewhere."""
        return Bucket(**(self.to_dict() | {"segment": segment, "offset": offset}))

    def specs(self) -> list[WeightSpec]:
        return [
            WeightSpec(name, tuple(shape), _dtype(dtype))
            for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]


def plan_buckets(
    specs: Sequence[WeightSpec], bucket_bytes: int, layers: Sequence[Sequence[str]]
) -> list[Bucket]:
    """Pack whole layers, in order, into buckets of at most `bucket_bytes` (a layer
    larger than that gets a bucket of its own). `layers` partitions the names in
    `specs` (vLLM's `layerwise_groups`). Sender and receivers use the same plan: it
    travels in the buckets. `segment`/`offset` are left for the sender to fill."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_name = {spec.name: spec for spec in specs}
    if len(by_name) != len(specs):
        names = [spec.name for spec in specs]
        raise ValueError(f"weight names must be unique, repeated: {_repeated(names)}")
    grouped = [name for layer in layers for name in layer]
    if sorted(grouped) != sorted(by_name):
        raise ValueError("the layers must hold every weight exactly once")
    packed: list[list[WeightSpec]] = [[]]
    for layer in layers:
        layer_specs = [by_name[name] for name in layer]
        if packed[-1] and _packed_bytes(packed[-1] + layer_specs) > bucket_bytes:
            packed.append([])
        packed[-1].extend(layer_specs)
    buckets, stored_at = [], 0
    for bucket_specs in packed if packed[-1] else []:
        offsets = _offsets(bucket_specs)
        nbytes = _packed_bytes(bucket_specs)
        buckets.append(
            Bucket(
                segment="",
                offset=0,
                names=[s.name for s in bucket_specs],
                dtype_names=[_dtype_name(s.dtype) for s in bucket_specs],
                shapes=[list(s.shape) for s in bucket_specs],
                offsets=offsets,
                nbytes=nbytes,
                stored_at=stored_at,
            )
        )
        stored_at += nbytes
    return [Bucket(**(b.to_dict() | {"model_bytes": stored_at})) for b in buckets]


def slot_bytes(plan: Sequence[Bucket]) -> int:
    """A ring slot's size: the largest bucket."""
    return max((bucket.nbytes for bucket in plan), default=0)


def bucket_views(memory: Tensor, bucket: Bucket) -> list[tuple[str, Tensor]]:
    """(name, tensor) views of a bucket laid out at the start of `memory` (bytes)."""
    views = []
    for spec, start in zip(bucket.specs(), bucket.offsets, strict=True):
        raw = memory[start : start + spec.nbytes]
        views.append((spec.name, raw.view(spec.dtype).view(spec.shape)))
    return views


def pack_bucket(memory: Tensor, bucket: Bucket, weights: Mapping[str, Tensor]) -> None:
    """Copy the bucket's tensors into `memory` (casting to the bucket's dtypes: fp32
    masters go straight into a bf16 bucket)."""
    for name, view in bucket_views(memory, bucket):
        view.copy_(weights[name])


class Segment:
    """A named shared-memory file under /dev/shm, mapped as a flat uint8 tensor.

    `create` allocates it whole (so a full /dev/shm fails here, naming the size, rather
    than as a SIGBUS on a later write) and removes the file on `close`; `attach` maps
    one that exists. Names are unique per creation: a mapping never outlives its file's
    contents being replaced."""

    def __init__(self, name: str, tensor: Tensor, owner: bool) -> None:
        self.name = name
        self.tensor = tensor
        self.owner = owner

    @classmethod
    def create(cls, prefix: str, nbytes: int) -> Segment:
        name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as error:
            path.unlink(missing_ok=True)
            raise TransferError(
                f"cannot create a shared-memory segment of {nbytes / 2**20:.1f} MiB in "
                f"{SHM_DIR}: {error.strerror or error} (a pod's /dev/shm is its "
                "memory-backed emptyDir: raise its size, or lower the bucket size)"
            ) from error
        return cls(name, _map(path, nbytes), owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        path = SHM_DIR / name
        try:
            nbytes = path.stat().st_size
        except OSError as error:
            raise TransferError(
                f"no shared-memory segment {name} in {SHM_DIR}: {error.strerror} (is the "
                "sender on another node or pod? Its engines take the weights over gloo)"
            ) from error
        return cls(name, _map(path, nbytes), owner=False)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self.owner = False


def _map(path: Path, nbytes: int) -> Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


@dataclass
class Segments:
    """The segments one side has mapped, by name, attached on first use."""

    mapped: dict[str, Segment] = field(default_factory=dict)

    def region(self, bucket: Bucket) -> Tensor:
        segment = self.mapped.get(bucket.segment)
        if segment is None:
            segment = self.mapped[bucket.segment] = Segment.attach(bucket.segment)
        if bucket.offset + bucket.nbytes > segment.tensor.numel():
            raise TransferError(f"bucket past the end of segment {bucket.segment}")
        return segment.tensor[bucket.offset : bucket.offset + bucket.nbytes]

    def read(self, bucket: Bucket) -> list[tuple[str, Tensor]]:
        """The bucket's tensors, as views of the shared memory (no copy)."""
        return bucket_views(self.region(bucket), bucket)

    def close(self) -> None:
        for segment in self.mapped.values():
            segment.close()
        self.mapped.clear()


class Ring:
    """`RING_SLOTS` slots of shared memory that buckets pass through, in turn."""

    def __init__(self, prefix: str, slot: int) -> None:
        self.slot = slot
        self.segment = Segment.create(prefix, RING_SLOTS * slot)

    def place(self, index: int, bucket: Bucket) -> Bucket:
        """Bucket number `index` of a transfer, placed in its slot of this ring."""
        if bucket.nbytes > self.slot:
            raise TransferError(f"a bucket of {bucket.nbytes} bytes, slots of {self.slot}")
        return bucket.at(self.segment.name, (index % RING_SLOTS) * self.slot)

    def region(self, bucket: Bucket) -> Tensor:
        return self.segment.tensor[bucket.offset : bucket.offset + bucket.nbytes]

    def close(self) -> None:
        self.segment.close()


class Relay:
    """An engine on another node than the sender: it takes each bucket over the gloo
    group into a ring of its own, at the sender's offset, for its vLLM worker to read."""

    def __init__(self, group: SyncGroup, ring: Ring) -> None:
        self.group = group
        self.ring = ring

    @classmethod
    def join(cls, init_info: Mapping[str, Any], engine_rank: int) -> Relay | None:
        """Join the sender's gloo group if `engine_rank` is among the remote engines of
        `init_info` (the host transfer's worker init, `HostTrainerWeightTransferEngine`);
        None for an engine on the sender's node. Returns once all have joined."""
        remote = list(init_info["remote"])
        if engine_rank not in remote:
            return None
        ring = Ring("rlhf-relay", int(init_info["slot_bytes"]))
        try:
            group = SyncGroup.create(
                init_info["address"], int(init_info["port"]), 1 + remote.index(engine_rank),
                1 + len(remote), timedelta(seconds=float(init_info["timeout_s"])),
            )  # fmt: skip
        except BaseException:
            ring.close()
            raise
        return cls(group, ring)

    def receive(self, bucket: Bucket) -> Bucket:
        """Receive the bucket the sender broadcasts; returns where it is now."""
        placed = bucket.at(self.ring.segment.name, bucket.offset)
        self.group.broadcast(self.ring.region(placed))
        return placed

    def close(self) -> None:
        self.group.close()
        self.ring.close()


class WeightStore:
    """The last weights an engine loaded, whole, in a segment of its own: what a
    restarted engine reloads before it serves. Filled bucket by bucket as the engine
    loads them (`keep`), valid once a transfer is complete (`commit`)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.segment: Segment | None = None
        self.incoming: list[Bucket] = []
        self.latest: tuple[list[Bucket], int] | None = None  # (buckets, version)

    def keep(self, bucket: Bucket, source: Tensor) -> None:
        """Copy one bucket (its bytes in `source`) into the store."""
        if self.segment is None or self.segment.tensor.numel() != bucket.model_bytes:
            self.close()
            self.segment = Segment.create(self.prefix, bucket.model_bytes)
        place = bucket.at(self.segment.name, bucket.stored_at)
        self.segment.tensor[place.offset : place.offset + place.nbytes].copy_(source)
        self.incoming.append(place)

    def fill(self, weights: Mapping[str, Tensor], layers: Sequence[Sequence[str]]) -> None:
        """Put whole weights in the store as one transfer would (to load them)."""
        for bucket in plan_buckets(weight_specs(weights), DEFAULT_BUCKET_BYTES, layers):
            memory = torch.empty(bucket.nbytes, dtype=torch.uint8)
            pack_bucket(memory, bucket, weights)
            self.keep(bucket, memory)

    def commit(self, version: int) -> None:
        self.latest, self.incoming = (self.incoming, version), []

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
        self.segment, self.latest, self.incoming = None, None, []


class SyncGroup:
    """A standalone gloo group: the sender (rank 0) and the engines on other nodes.

    Built from a `TCPStore` that rank 0 hosts on `port`, never registered with
    torch.distributed: the default process group (if any) is neither used nor changed.
    """

    def __init__(self, process_group: ProcessGroup, store: Store) -> None:
        self._pg: ProcessGroup | None = process_group
        self._store: Store | None = store
        self.rank = process_group.rank()
        self.world_size = process_group.size()

    @classmethod
    def create(
        cls, host: str, port: int, rank: int, world_size: int, timeout: timedelta
    ) -> SyncGroup:
        """Join the group; every rank calls this and it returns once all have joined."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        tcp_store = TCPStore(
            host, port, world_size, is_master=rank == SENDER, timeout=timeout,
            wait_for_workers=False,
        )  # fmt: skip
        store = PrefixStore("weight-sync/", tcp_store)
        pg = ProcessGroup(store, rank, world_size)
        backend = ProcessGroupGloo(store, rank, world_size, timeout)
        backend._set_sequence_number_for_group()
        pg._set_default_backend(ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
        return cls(pg, tcp_store)

    def broadcast(self, tensor: Tensor) -> None:
        """Broadcast `tensor` (in host memory) from the sender, in place."""
        if self._pg is None:
            raise RuntimeError("the sync group is closed")
        self._pg.broadcast(tensor, SENDER).wait()

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


def _packed_bytes(specs: Sequence[WeightSpec]) -> int:
    """Bytes from the first tensor's start to the last one's end."""
    if not specs:
        return 0
    return _offsets(specs)[-1] + specs[-1].nbytes


def _offsets(specs: Sequence[WeightSpec]) -> list[int]:
    """Where each tensor starts, in bytes: in order, each aligned to ALIGN."""
    offsets, offset = [], 0
    for spec in specs:
        offsets.append(offset)
        offset = -(-(offset + spec.nbytes) // ALIGN) * ALIGN
    return offsets


def _repeated(names: Sequence[str]) -> list[str]:
    counts = dict.fromkeys(names, 0)
    for name in names:
        counts[name] += 1
    return sorted(name for name, count in counts.items() if count > 1)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"not a torch dtype: {name!r}")
    return dtype
