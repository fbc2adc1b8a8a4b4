"""Weight transfer through vLLM's own API for RL: the trainer side builds a
`TrainerWeightTransferEngine` with `WeightTransferTrainerFactory.trainer_init` and calls
its `send_weights`; that drives every engine through `init_weight_transfer_engine`,
`start_weight_update`, `update_weights` and `finish_weight_update(weight_version)`.

The backend follows the placement (`api.transfer.choose_transfer`), and nothing else
changes:

    nccl       vLLM's: engines on GPUs of another pool, one NCCL broadcast
    ipc        vLLM's: engines on the actor's own GPUs (CUDA IPC, no copy through the host)
    rlhf_host  this module's, registered with both of vLLM's factories: CPU machines.
               Engines on the sender's node read the weights from its ring in shared
               memory, those on other nodes take them over gloo (the data plane is
               `weight_sync`).

vLLM builds the worker side of the backend inside its worker process (the engine's
`weight_transfer_config`), so the backend must be registered there first: vLLM mixes
`WorkerExtension` into every worker (`worker_extension_cls`), which imports this
module, which registers the backend.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Self

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    layerwise_groups,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from rlhf_trainer.api.transfer import nccl_ranks
from rlhf_trainer.rollout.engine_weights import is_engine_weight, refresh_tied_lm_head
from rlhf_trainer.rollout.transfer_memory import (
    RING_SLOTS,
    RelayInit,
    Ring,
    Segments,
    SyncGroup,
)
from rlhf_trainer.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    HOST_TRANSFER,
    Bucket,
    EngineFanOut,
    TransferSetup,
    WeightSpec,
    bucket_views,
    plan_buckets,
    slot_bytes,
)

# vLLM's IPC sender packs the policy into one reusable GPU buffer, a chunk at a time,
# rather than keeping every gathered tensor alive until the push ends (a whole copy of
# the model on each GPU during a sync). Packing needs CUDA streams: the CPU tests' stand-
# in for CUDA IPC sets this False.
IPC_PACKED = True
IPC_CHUNK_BYTES = 2**30  # vLLM's default; at least the largest tensor (its sender's rule)


def trainer_init_info(
    rank: int, setup: TransferSetup, largest_tensor_bytes: int = 0
) -> TrainerInitInfo:
    """The trainer side's init info for `setup.backend`, on actor rank `rank` (0 sends).
    `largest_tensor_bytes`: the policy's largest tensor as the engines get it (IPC's
    chunk must hold it)."""
    backend = setup.backend
    if backend == HOST_TRANSFER:
        return HostTrainerInitInfo(
            setup.address, setup.port, list(setup.remote_engines), setup.bucket_bytes,
            setup.timeout_s, rank=rank,
        )  # fmt: skip
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        # The sender and every engine's workers (TP x PP each), not one rank per engine.
        world = nccl_ranks(setup.engines, setup.workers_per_engine).world_size
        return NCCLTrainerInitInfo(setup.address, setup.port, world, rank=rank)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        chunk = max(IPC_CHUNK_BYTES, largest_tensor_bytes)
        return IPCTrainerInitInfo(rank=rank, packed=IPC_PACKED, packed_buffer_size_bytes=chunk)
    raise ValueError(f"no weight-transfer backend {backend!r}: nccl, ipc or {HOST_TRANSFER}")


class PolicySource(WeightSource):  # type: ignore[misc]  # vLLM is untyped here
    """The policy as the engines load it: checkpoint (Hugging Face) names, the engines'
    dtype, and without the LM head when it is tied to the embeddings (vLLM's loader has
    no parameter of its own for it). Iterating gathers each sharded tensor whole on
    every rank (`DTensor.full_tensor`, a collective), one tensor at a time: every rank
    must take part in every gather of a push, in order (`finish_pass`)."""

    def __init__(self, model: nn.Module, tied: bool, dtype: torch.dtype) -> None:
        self.model = model
        self.tied = tied
        self.dtype = dtype
        self.gathering: Iterator[tuple[str, Tensor]] | None = None  # this push's pass

    def _named(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self.model.state_dict().items():
            if is_engine_weight(name, self.tied):
                yield name, tensor

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, self.dtype, tuple(t.shape)) for name, t in self._named()]

    def largest_tensor_bytes(self) -> int:
        """The bytes of the largest tensor the engines get (in their dtype)."""
        size = self.dtype.itemsize
        return max((t.numel() * size for _, t in self._named()), default=0)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        if torch.cuda.is_available():
            # vLLM's packed NCCL sender iterates (and so gathers) on side streams of its
            # own, which wait for nothing queued on this rank's stream: the optimizer
            # step must be done before the first gather reads the shards.
            torch.cuda.synchronize()
        self.gathering = self._gathered()
        return self.gathering

    def _gathered(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self._named():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach().to(self.dtype)

    def finish_pass(self) -> None:
        """Take part in the gathers of this push that this rank has not (all of them if
        it has not begun: a sender that failed before it iterated), so that the other
        ranks' gathers end; the next push begins a pass of its own. Call it once a
        push has ended, on every rank."""
        rest = self.gathering if self.gathering is not None else self._gathered()
        self.gathering = None
        for _ in rest:
            pass


def abort_sender(transfer: Any) -> None:
    """End the sender's side of a weight transfer at once, from any thread: a broadcast
    still waiting on an engine that failed ends. vLLM's NCCL sender is aborted through
    its communicator (PyNcclCommunicator.destroy: ncclCommAbort; its broadcasts then do
    nothing), not through `shutdown`, which drops the communicator that the sender's
    broadcast loop still reads. Other transfers shut down."""
    communicator = getattr(transfer, "model_update_group", None)  # vLLM's NCCL sender's
    if communicator is not None:
        communicator.destroy()
    else:
        transfer.shutdown()


# --- the host backend: the worker side, in each vLLM worker ----------------------


@dataclass
class HostInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM is untyped here
    """Nothing to rendezvous: each bucket names the segment it is in."""


@dataclass
class HostUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]  # vLLM is untyped here
    bucket: Bucket


class HostWeightTransferEngine(WeightTransferEngine[HostInitInfo, HostUpdateInfo]):  # type: ignore[misc]  # vLLM is untyped here
    """Loads each bucket straight from shared memory into the model, through vLLM's
    layerwise reload (the same loader as `reload_weights`: on CPU the kernels repack
    the weights after loading, and a plain copy into the parameters would be wrong)."""

    init_info_cls = HostInitInfo
    update_info_cls = HostUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.segments = Segments()

    def init_transfer_engine(self, init_info: HostInitInfo) -> None:
        pass

    def parse_update_info(self, update_dict: dict[str, Any]) -> HostUpdateInfo:
        return HostUpdateInfo(Bucket.from_dict(update_dict))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.segments.prune()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base waits for the accelerator here; on CPU there is none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: HostUpdateInfo) -> None:
        self.model.load_weights(self.segments.read(update_info.bucket))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_lm_head(self.model)

    def shutdown(self) -> None:
        self.segments.close()


Layer = tuple[list[str], list[Tensor]]  # a gathered layer: names, whole tensors


# --- the host backend: the trainer side, in the actor's ranks ---------------------


@dataclass
class HostTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]  # vLLM is untyped here
    """`remote_engines`: the engine ranks on other nodes than the sender's; they take
    the buckets over a gloo group at `master_address:master_port`, in that order."""

    backend: ClassVar[str] = HOST_TRANSFER

    master_address: str
    master_port: int
    remote_engines: list[int] = field(default_factory=list)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


class HostTrainerWeightTransferEngine(TrainerWeightTransferEngine[HostTrainerInitInfo]):  # type: ignore[misc]  # vLLM is untyped here
    """Sends bucket by bucket, and has the engines load each bucket while it makes the
    next: the tensors they can read where the actor keeps them are named there, the
    rest packed into the ring (two slots), which goes over gloo to the engines on other
    nodes meanwhile. Its client is an `EngineFanOut`, whose calls can be sent ahead of
    their answers."""

    init_info_cls = HostTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        init_info: HostTrainerInitInfo,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.plan: list[Bucket] = []
        self.ring: Ring | None = None
        self.group: SyncGroup | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: HostTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("the host weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, init_info=init_info)
        if not engine.is_sender:
            return engine
        meta = source.metadata()
        specs = [WeightSpec(m.name, m.shape, m.dtype) for m in meta]
        layers = layerwise_groups([m.name for m in meta])
        engine.plan = plan_buckets(specs, init_info.bucket_bytes, layers)
        engine.ring = Ring("rlhf-weights", slot_bytes(engine.plan))
        remote = init_info.remote_engines
        address, port = init_info.master_address, init_info.master_port
        relay = RelayInit(remote, address, port, engine.ring.slot, init_info.timeout_s)
        # The engines on other nodes join the gloo group inside the call: together, and
        # whichever side fails first says why (the other would wait for its timeout).
        pool = ThreadPoolExecutor(max_workers=2)
        joining = [pool.submit(client.init_weight_transfer_engine, relay.to_dict())]
        if remote:
            timeout = timedelta(seconds=init_info.timeout_s)
            group = pool.submit(SyncGroup.create, address, port, 0, 1 + len(remote), timeout)
            joining.append(group)
        try:
            for future in wait(joining, return_when=FIRST_EXCEPTION).done:
                future.result()
            for future in joining:
                future.result()
        except BaseException:
            engine.shutdown()
            raise
        finally:
            pool.shutdown(wait=False)
        if remote:
            engine.group = joining[1].result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:  # the other ranks' part of each gather
                pass
            return
        client = self.client
        if not isinstance(client, EngineFanOut):
            raise TypeError(
                f"the {HOST_TRANSFER} transfer needs an EngineFanOut client, not {client!r}"
            )
        layers = self.source.iter_groups()
        try:
            self._send(client, layers)
        except BaseException:
            # The other ranks gather every tensor, whatever happens here: let them end
            # (a generator that raised is done). Closing the transfer makes an engine
            # waiting on the relay for a bucket fail at once; the driver sets it up
            # again for the engines that go on.
            for _ in layers:
                pass
            self.shutdown()
            raise

    def _send(self, client: EngineFanOut, layers: Iterator[Layer]) -> None:
        assert self.ring is not None
        client.push_bytes = sum(bucket.nbytes for bucket in self.plan)
        client.start_weight_update()
        # Up to RING_SLOTS buckets in the engines' hands at once: each engine has the
        # next one queued when it finishes one (its calls run in the order sent).
        loading: deque[Any] = deque()
        for index, bucket in enumerate(self.plan):
            if len(loading) == RING_SLOTS:
                client.wait(loading.popleft())  # this bucket's slot is free again
            tensors: dict[str, Tensor] = {}
            while len(tensors) < len(bucket.names):
                names, values = next(layers)
                tensors.update(zip(names, values, strict=True))
            placed = self.ring.place(index, bucket)
            for name, place in bucket_views(self.ring.region(placed), placed):
                place.copy_(tensors[name])
            loading.append(client.submit("update_weights", placed.to_dict()))
            if self.group is not None:
                self.group.broadcast(self.ring.region(placed))
        while loading:
            client.wait(loading.popleft())
        client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        if self.ring is not None:
            self.ring.close()
        self.group = self.ring = None


class WorkerExtension:
    """Mixed into every vLLM worker only so that vLLM imports this module there."""


def register() -> None:
    """Make the host backend known to vLLM's factories, in this process (idempotent)."""
    if HOST_TRANSFER not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(HOST_TRANSFER, HostWeightTransferEngine)
    if HOST_TRANSFER not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(HOST_TRANSFER, HostTrainerWeightTransferEngine)


register()
