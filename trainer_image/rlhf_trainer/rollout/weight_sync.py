"""The wire format of the `rlhf_host` weight transfer (`transfer_engines`): how new
policy weights are cut into buckets and described; and the fan-out of vLLM's calls to
the engines (`EngineFanOut`), which gives each engine its own ranks in vLLM's NCCL
group. Which backend a job takes is `api.transfer`'s decision. The memory the buckets
pass through is `transfer_memory`'s.

    actor rank 0 ─copy─▶ ring (shared memory) ─copy─▶ vLLM worker of an engine on its node
                              │
                              └─gloo─▶ ring of an engine on another node ─copy─▶
                                       its vLLM worker

Every tensor is packed into the sender's ring and read from there. (Reading the actor's
own parameters in place, through its file descriptors, halved the data plane's time but
not a sync's: vLLM's reload is ~90% of it; bench/README.md has the numbers.)

The weights travel in buckets (`plan_buckets`): whole layers, packed in order into
flat byte runs of at most `bucket_bytes` (a layer larger than that is a bucket of its
own). Whole layers, because vLLM's layerwise reload keeps a layer's tensors until the
layer is complete: a bucket never leaves a layer half loaded for the next one to
overwrite. Each bucket is described by a `Bucket` (the segment and offset to read, and
each tensor's name, dtype, shape and offset in the bucket): that is the `update_info`
that travels through vLLM's `update_weights`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_trainer.api.transfer import Backend, nccl_ranks

DEFAULT_BUCKET_BYTES = 256 * 2**20
ALIGN = 64  # bytes: each tensor of a bucket starts on a cache line
HOST_TRANSFER = Backend.HOST.value  # the name of this transfer among vLLM's (transfer_engines)


@dataclass(frozen=True)
class TransferSetup:
    """What the driver tells the actor's ranks about a job's weight transfer: the
    sender's address (for the backends that rendezvous), how many engines, and which
    of them run on other nodes than the sender (the host transfer reaches those over
    gloo). `timeout_s`: how long a collective of the transfer may wait. `backend`: the
    one the engines were built with (`api.transfer.choose_transfer`), and
    `workers_per_engine` their vLLM workers each (TP x PP)."""

    address: str
    port: int
    engines: int
    remote_engines: tuple[int, ...]
    bucket_bytes: int
    timeout_s: float
    backend: str = HOST_TRANSFER
    workers_per_engine: int = 1


@dataclass(frozen=True)
class EngineTransfer:
    """What an engine was built with, for the transfer: its backend and workers."""

    backend: str
    workers: int  # vLLM workers of the engine: TP x PP


def agreed_transfer(engines: Sequence[EngineTransfer], ranks: Sequence[int]) -> EngineTransfer:
    """The transfer every engine (rollout rank `ranks[i]`) was built with; they must
    agree, since one trainer-side engine drives them all."""
    kinds: dict[EngineTransfer, list[int]] = {}
    for rank, engine in zip(ranks, engines, strict=True):
        kinds.setdefault(engine, []).append(rank)
    if len(kinds) != 1:
        described = "; ".join(
            f"rollout rank(s) {', '.join(map(str, rs))}: {e.backend} with {e.workers} worker(s)"
            for e, rs in kinds.items()
        )
        raise TransferError(f"the engines disagree on the weight transfer: {described}")
    return engines[0]


def nccl_init_infos(
    init_info: Mapping[str, Any], engines: int, workers_per_engine: int
) -> list[dict[str, Any]]:
    """vLLM's NCCL worker init payload, one per engine. vLLM's NCCL trainer sends
    every engine the same payload, with `rank_offset` 1 and a `world_size` of its own:
    right for one engine, not for several separate ones. Each gets its own offset and
    the world of all of them (`api.transfer.nccl_ranks`)."""
    ranks = nccl_ranks(engines, workers_per_engine, first=int(init_info["rank_offset"]))
    return [
        dict(init_info) | {"rank_offset": offset, "world_size": ranks.world_size}
        for offset in ranks.rank_offsets
    ]


class EngineFanOut:
    """vLLM's `VLLMWeightSyncClient` for a set of engines: each of its calls made on
    every engine (vLLM's NCCL `init_weight_transfer_engine` with each engine's own
    ranks: `nccl_init_infos`). A call can also be sent now and its answers awaited later
    (`submit`, `submit_each`, `wait`, `engine_count`: the subclass's business); each
    engine runs the calls in the order they were sent. `version` is what the next
    `finish_weight_update` labels the weights: vLLM's NCCL and IPC engines finish
    without one, so the sender sets it before each send, and `push_bytes` the bytes the
    push moves (its phases' deadlines are sized from them: `sync_deadlines`)."""

    version = 0
    push_bytes = 0
    workers_per_engine = 1  # vLLM workers of each engine: TP x PP
    # Told, on the thread that waited, when a call fails on an engine. The sender
    # aborts its end of the transfer there: vLLM's NCCL sender broadcasts while its
    # calls run on another thread, and a broadcast to an engine that is gone would
    # otherwise wait for ever (NCCL has no timeout of its own).
    on_failure: Callable[[], None] | None = None

    @property
    def engine_count(self) -> int:
        raise NotImplementedError

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if "rank_offset" not in init_info:  # not vLLM's NCCL: the same for every engine
            self.wait(self.submit("init_weight_transfer_engine", init_info))
            return
        payloads = nccl_init_infos(init_info, self.engine_count, self.workers_per_engine)
        self.wait(self.submit_each("init_weight_transfer_engine", payloads))

    def shutdown_weight_transfer_engine(self) -> None:
        """Close each engine's side of the transfer (before another is opened)."""
        self.wait(self.submit("shutdown_weight_transfer_engine"))

    def start_weight_update(self) -> None:
        self.wait(self.submit("start_weight_update"))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.wait(self.submit("update_weights", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = self.version if weight_version is None else int(weight_version)
        self.wait(self.submit("finish_weight_update", version))

    def submit(self, method: str, *args: Any) -> Any:
        """Send the call to every engine; returns what `wait` takes."""
        raise NotImplementedError

    def submit_each(self, method: str, firsts: Sequence[Any]) -> Any:
        """Send the call to every engine, engine i with `firsts[i]`; returns what
        `wait` takes."""
        raise NotImplementedError

    def wait(self, sent: Any) -> Any:
        """Wait for every engine's answer to a call `submit` sent; raise its failure,
        after telling `on_failure`."""
        try:
            return self.answers(sent)
        except BaseException:
            if self.on_failure is not None:
                self.on_failure()
            raise

    def answers(self, sent: Any) -> Any:
        """Every engine's answer to a call `submit` sent; raises the first failure."""
        raise NotImplementedError


class TransferError(RuntimeError):
    """A weight transfer could not start or go on; the message says which and why."""


CONFIG_FILE = "adapter_config.json"  # the names peft writes and vLLM reads
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterFiles:
    """A LoRA adapter in peft's format, as bytes: what a sync sends in LoRA RL in place
    of the buckets (megabytes: it travels in one Ray call per engine)."""

    config_json: bytes  # adapter_config.json
    weights: bytes  # adapter_model.safetensors

    @property
    def nbytes(self) -> int:
        return len(self.config_json) + len(self.weights)

    def write(self, directory: Path) -> Path:
        """The two files in `directory` (made if need be); returns it."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_bytes(self.config_json)
        (directory / WEIGHTS_FILE).write_bytes(self.weights)
        return directory


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
    a copy of the whole model (`PackedWeights`), `model_bytes` that copy's size. Travels
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
        """The same bucket, packed elsewhere."""
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
