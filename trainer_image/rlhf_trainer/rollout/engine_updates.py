"""How a rollout engine takes new weights, through vLLM's weight-transfer API
(`transfer_engines`); mixed into `engine.RolloutEngine`.

A weight update is `open_update()` -> `load_bucket()` per bucket -> `close_update(version)`:

- `open_update` pauses a running engine as vLLM's
  `pause_generation(mode="keep", clear_cache=False)` does (`pause_scheduler`, without its
  closing sleep): the scheduler stops stepping and in-flight requests stay where they
  are (tokens, log-probs, sampler state) - a partial rollout, not an abort - then
  `start_weight_update`.
- `load_bucket` is vLLM's `update_weights`: the transfer engine in vLLM's worker loads
  the bucket into the model.
- `close_update` is `finish_weight_update(weight_version=...)`, which labels the
  engine's outputs with the new version, then
  `reset_prefix_cache(reset_running_requests=True)`, then `resume_generation()` if
  `open_update` paused the engine. An update that fails leaves the engine paused: it
  never serves a half-loaded model.
- `abandon_update` closes an update that a failed push left open (another engine was
  lost mid-way) without serving it: the engine stays paused, and the next push's
  update, which loads every bucket again, resumes it.

`load_weights` and `update_weights` take whole weights (tests, a local engine) through
the same calls.

LoRA RL (`models.actor.lora`): the engine keeps its base and takes each new adapter
whole in one call, `load_adapter`: written to a fresh directory on this node and loaded
in place by vLLM's LoRA support (`add_lora`); every request from then on uses it
(`lora_request`). It pauses, labels and resumes as a weight update does.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor

from rlhf_trainer.rollout.engine_death import utility
from rlhf_trainer.rollout.transfer_memory import PackedWeights
from rlhf_trainer.rollout.weight_sync import AdapterFiles, Bucket

T = TypeVar("T")

ADAPTER_NAME, ADAPTER_ID = "policy", 1  # the one adapter an engine serves, replaced in place
SHARED_MEMORY = Path("/dev/shm")  # where adapters are written when the node has it


class WeightUpdates:
    """The weight updates of `RolloutEngine`, which provides what is declared here."""

    _llm: Any
    policy_version: int
    _updating: bool  # between open_update and close_update
    _resume_after_update: bool  # open_update paused a running engine
    lora_request: Any  # vLLM's LoRARequest of the adapter served (LoRA RL), else None
    _adapter_dir: Path | None  # where that adapter's files are

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    async def _alive(self, operation: Callable[[Any], Awaitable[T]]) -> T:
        raise NotImplementedError

    async def _pause(self, llm: Any) -> None:
        raise NotImplementedError

    async def _resume(self, llm: Any) -> None:
        raise NotImplementedError

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Set up vLLM's weight-transfer engine (vLLM's `init_weight_transfer_engine`)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info)
        self.call(self._alive(lambda llm: utility(llm, llm.init_weight_transfer_engine(request))))

    def shutdown_transfer(self) -> None:
        """Close vLLM's weight-transfer engine's connection to the trainer (an NCCL
        group, IPC buffers), the engine serving on: vLLM's
        `shutdown_weight_transfer_engine`, before another transfer is set up."""

        async def shutdown(llm: Any) -> None:
            await utility(llm, llm.shutdown_weight_transfer_engine())

        self.call(self._alive(shutdown))

    def open_update(self) -> None:
        """Pause a running engine (its requests keep their tokens) and start an update."""

        async def start(llm: Any) -> None:
            if not await utility(llm, llm.is_paused()):
                await pause_scheduler(llm)
                self._resume_after_update = True
            await utility(llm, llm.start_weight_update())

        self.call(self._alive(start))
        self._updating = True

    def load_bucket(self, update_info: dict[str, Any]) -> None:
        """Load one bucket of the update (vLLM's `update_weights`)."""
        self.call(self._alive(lambda llm: self._load_bucket(llm, update_info)))

    def close_update(self, version: int) -> None:
        """End the update: label what follows as `version`, drop the KV cache computed
        with the old weights, and resume an engine that `open_update` paused."""
        self.call(self._alive(lambda llm: self._finish(llm, version)))
        self._updating = False
        if self._resume_after_update:
            self._resume_after_update = False
            self.call(self._alive(self._resume))

    def abandon_update(self) -> None:
        """Close an update left open, unserved: vLLM puts the old weights back in the
        layers not loaded yet, and the engine stays paused (`close_update` of the next
        update resumes it if `open_update` paused it). No update open: nothing to do."""
        if not self._updating:
            return
        self.call(self._alive(lambda llm: utility(llm, llm.finish_weight_update())))
        self._updating = False

    @staticmethod
    async def _load_bucket(llm: Any, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await utility(llm, llm.update_weights(WeightTransferUpdateRequest(update_info)))

    def served_version(self) -> int:
        """The weight version vLLM labels its outputs with now."""
        return int(self.call(self._alive(lambda llm: utility(llm, llm.get_weight_version()))))

    async def _finish(self, llm: Any, version: int) -> None:
        await utility(llm, llm.finish_weight_update())
        await self._serve_as(llm, version)

    async def _serve_as(self, llm: Any, version: int) -> None:
        """Label what follows as `version`, and drop the KV computed with the old weights."""
        await utility(llm, llm.update_weight_version(str(version)))
        if not await utility(llm, llm.reset_prefix_cache(reset_running_requests=True)):
            raise RuntimeError("vLLM could not drop the KV cache of the old weights")
        self.policy_version = version

    def load_adapter(self, files: AdapterFiles, version: int) -> None:
        """Serve a new LoRA adapter as `version`, over the base the engine keeps (from any
        other thread). A running engine pauses (its requests keep their tokens) and
        resumes on it; a paused one stays paused; one that fails to load stays paused."""
        from vllm.lora.request import LoRARequest

        where = SHARED_MEMORY if SHARED_MEMORY.is_dir() else None  # else the tmp dir
        directory = files.write(Path(tempfile.mkdtemp(prefix="rlhf-adapter-", dir=where)) / "v")
        # load_inplace replaces the adapter served under the one id. The requests must
        # not carry it: vLLM's worker reloads a load_inplace adapter from its files for
        # every batch that holds such a request (LRUCacheWorkerLoRAManager.add_adapter),
        # and a request still running from before (partial rollout) names files gone.
        replace = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(directory), load_inplace=True)
        request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(directory))

        async def load(llm: Any) -> None:
            paused_here = not await utility(llm, llm.is_paused())
            if paused_here:
                await self._pause(llm)
            if not await utility(llm, llm.add_lora(replace)):
                raise RuntimeError(f"vLLM did not load the adapter of version {version}")
            self.lora_request = request
            await self._serve_as(llm, version)
            if paused_here:
                await self._resume(llm)

        try:
            self.call(self._alive(load))
        except BaseException:
            shutil.rmtree(directory.parent, ignore_errors=True)
            raise
        # vLLM keeps the adapter in memory; its files stay until the next one is served.
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        self._adapter_dir = directory.parent

    async def _load(self, llm: Any, buckets: Sequence[Bucket], version: int) -> None:
        """Load whole packed weights into `llm` (paused) as `version`."""
        await utility(llm, llm.start_weight_update())
        for bucket in buckets:
            await self._load_bucket(llm, bucket.to_dict())
        await self._finish(llm, version)

    async def update_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load whole new weights (checkpoint names). Call it between `pause` and
        `resume`: in-flight requests lose their KV (computed with the old weights)
        and re-prefill their prefix with the new weights on resume; the tokens they
        generate from then on count as `version`."""
        packed = packed_weights(weights)
        try:
            llm = self._llm
            if not await utility(llm, llm.is_paused()):
                raise RuntimeError("update_weights needs a paused engine (call pause first)")
            await self._alive(lambda llm: self._load(llm, packed.buckets, version))
        finally:
            packed.close()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load whole new weights and wait (from any other thread). A paused engine
        stays paused; a running one pauses for the update and resumes on the new weights."""
        packed = packed_weights(weights)
        try:
            self.open_update()
            for bucket in packed.buckets:
                self.load_bucket(bucket.to_dict())
            self.close_update(version)
        finally:
            packed.close()


async def pause_scheduler(llm: Any) -> None:
    """vLLM's `pause_generation(mode="keep", clear_cache=False)` without its closing
    20 ms sleep, which only lets the last outputs reach their streams first (vLLM says it
    is not needed for correctness). A push waits for it: 20 ms of a 45-50 ms push of the
    async bench's model. The outputs keep their versions (vLLM labels each step's outputs
    in the engine core), so their order against the update does not matter."""
    await utility(llm, llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False))


def packed_weights(weights: Iterable[tuple[str, Tensor]]) -> PackedWeights:
    """Whole weights as one transfer's buckets, in shared memory, grouped by vLLM's layers."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    named = dict(weights)
    return PackedWeights("rlhf-load", named, layerwise_groups(list(named)))
