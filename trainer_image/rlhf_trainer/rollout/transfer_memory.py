"""The memory the `rlhf_host` weight transfer's buckets pass through (`weight_sync`
has their format): named shared-memory segments; the rings of two slots that buckets
take turns in; the gloo group and relay that reach an engine on another node (another
pod: /dev/shm is per pod); and whole weights packed for a local load (`PackedWeights`).

The sender packs each bucket into its ring: it has `RING_SLOTS` slots, each as large as
the largest bucket; bucket k goes to slot k % RING_SLOTS. An engine on the sender's
node reads it there; one on another node receives it over the gloo group into a ring
of its own, at the same offset, and its vLLM worker reads it there.

Peak extra memory: on the sender, its ring (RING_SLOTS x the largest bucket); on an
engine on another node, the same; on every engine, whatever vLLM's loader keeps.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
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

from rlhf_trainer.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    TransferError,
    bucket_views,
    pack_bucket,
    plan_buckets,
    weight_specs,
)

RING_SLOTS = 2  # the sender fills one slot while the engines read the other
# Memory-backed on Linux (a pod's is an emptyDir of medium Memory); elsewhere a temp dir.
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
PREFIX = "rlhf-"  # every segment's name: PREFIX...-<creator's pid>-<random>
SENDER = 0  # the gloo group's rank 0 sends


class Segment:
    """A named shared-memory file under /dev/shm, mapped as a flat uint8 tensor.

    `create` allocates it whole (so a full /dev/shm fails here, naming the size, rather
    than as a SIGBUS on a later write) and removes the file on `close`; `attach` maps
    one that exists. Names are unique per creation: a mapping never outlives its file's
    contents being replaced. A process killed outright leaves its files behind: each
    `create` first removes those of processes that are gone."""

    def __init__(self, name: str, tensor: Tensor, owner: bool) -> None:
        self.name = name
        self.tensor = tensor
        self.owner = owner

    @classmethod
    def create(cls, prefix: str, nbytes: int) -> Segment:
        if not prefix.startswith(PREFIX):
            raise ValueError(f"a segment's name starts with {PREFIX!r}, not {prefix!r}")
        remove_orphans()
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
        """Map segment `name`, a file of SHM_DIR."""
        path = SHM_DIR / name
        try:
            nbytes = path.stat().st_size
        except OSError as error:
            raise TransferError(
                f"no shared-memory segment {name}: {error.strerror} (is the sender on "
                "another node or pod? Its engines take the weights over gloo)"
            ) from error
        return cls(name, _map(path, nbytes), owner=False)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self.owner = False


def remove_orphans() -> list[str]:
    """Remove the segments whose creator is no longer alive; returns their names."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name.rsplit("-", 2)[-2] if path.name.count("-") >= 2 else ""
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def _map(path: Path, nbytes: int) -> Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


@dataclass
class Segments:
    """The segments one side has mapped, by name, attached on first use and kept from
    one update to the next (a fresh mapping would fault every page in again); `prune`
    drops those whose file is gone (a ring closed by its sender)."""

    mapped: dict[str, Segment] = field(default_factory=dict)

    def region(self, name: str, offset: int, nbytes: int) -> Tensor:
        segment = self.mapped.get(name)
        if segment is None:
            segment = self.mapped[name] = Segment.attach(name)
        if offset + nbytes > segment.tensor.numel():
            raise TransferError(f"{nbytes} bytes at {offset} are past the end of {name}")
        return segment.tensor[offset : offset + nbytes]

    def read(self, bucket: Bucket) -> list[tuple[str, Tensor]]:
        """The bucket's tensors, as views of the shared memory (no copy)."""
        return bucket_views(self.region(bucket.segment, bucket.offset, bucket.nbytes), bucket)

    def prune(self) -> None:
        for name in [n for n in self.mapped if not _exists(n)]:
            self.mapped.pop(name).close()

    def close(self) -> None:
        for segment in self.mapped.values():
            segment.close()
        self.mapped.clear()


def _exists(name: str) -> bool:
    return (SHM_DIR / name).exists()


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


@dataclass(frozen=True)
class RelayInit:
    """What the sender tells every engine as the transfer is set up (vLLM's
    `init_info`, as a dict): which engines are on other nodes (by rank), the sender's
    gloo address, the ring's slot size, and how long the group's collectives wait."""

    remote: list[int]
    address: str
    port: int
    slot_bytes: int
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Relay:
    """An engine on another node than the sender: it takes each bucket over the gloo
    group into a ring of its own, at the sender's offset, for its vLLM worker to read."""

    def __init__(self, group: SyncGroup, ring: Ring) -> None:
        self.group = group
        self.ring = ring

    @classmethod
    def join(cls, init_info: Mapping[str, Any], engine_rank: int) -> Relay | None:
        """Join the sender's gloo group if `engine_rank` is among the remote engines of
        `init_info` (a `RelayInit` as a dict); None for an engine on the sender's node.
        Returns once all have joined."""
        init = RelayInit(**init_info)
        if engine_rank not in init.remote:
            return None
        ring = Ring("rlhf-relay", init.slot_bytes)
        try:
            group = SyncGroup.create(
                init.address, init.port, 1 + init.remote.index(engine_rank),
                1 + len(init.remote), timedelta(seconds=init.timeout_s),
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


class PackedWeights:
    """Whole weights packed into a segment of their own, as the buckets of one transfer:
    how a local caller (a test, a benchmark) hands weights to an engine through the
    calls the actor makes. `close` removes the segment."""

    def __init__(
        self, prefix: str, weights: Mapping[str, Tensor], layers: Sequence[Sequence[str]]
    ) -> None:
        planned = plan_buckets(weight_specs(weights), DEFAULT_BUCKET_BYTES, layers)
        model_bytes = planned[0].model_bytes if planned else 0
        self.segment = Segment.create(prefix, model_bytes)
        self.buckets: list[Bucket] = []
        for bucket in planned:
            place = bucket.at(self.segment.name, bucket.stored_at)
            pack_bucket(self.segment.tensor[place.offset : place.offset + place.nbytes],
                        bucket, weights)  # fmt: skip
            self.buckets.append(place)

    def close(self) -> None:
        self.segment.close()


class SyncGroup:
    """A standalone gloo group: the sender (rank 0) and the engines on other nodes.

    Built from a `TCPStore` that rank 0 hosts on `port`, never registered with
    torch.distributed: the default process group (if any) is neither used nor changed.
    """

    def __init__(self, process_group: ProcessGroup, store: Store) -> None:
        self._pg: ProcessGroup | None = process_group
        self._store: Store | None = store  # the TCPStore lives as long as the group

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
        return cls.over(tcp_store, rank, world_size, timeout)

    @classmethod
    def over(cls, store: Store, rank: int, world_size: int, timeout: timedelta) -> SyncGroup:
        """A gloo group over a store that every rank reaches (and that lives as long
        as the group); returns once all ranks have joined."""
        prefixed = PrefixStore("weight-sync/", store)
        pg = ProcessGroup(prefixed, rank, world_size)
        backend = ProcessGroupGloo(prefixed, rank, world_size, timeout)
        backend._set_sequence_number_for_group()
        pg._set_default_backend(ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
        return cls(pg, store)

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
