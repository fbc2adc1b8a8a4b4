"""A weight push that fails ends the same way on every rank of the actor.

Each item of the policy's weight source is an FSDP all-gather over every actor rank, and
only rank 0 talks to the engines. vLLM's senders raise an engine's failure on rank 0
alone, wherever it happens: NCCL's before it iterates the source when
`start_weight_update` fails (the other ranks then wait in the first gather), IPC's
before its closing barrier (the others wait in it). Those ranks would wait for the
group's timeout, and the run would fail on a lost actor rank instead of replacing the
engine. So:

- on rank 0, vLLM's sender calls the engines through `DeferredCalls`: a call that fails
  is kept, not raised, and the calls after it are skipped. The sender then runs its own
  collectives to the end, in its own order, on every rank (NCCL's broadcasts do nothing
  once the failure has aborted its communicator: `WeightPush.abort`). Our host sender
  drains its source on an error itself, and takes the engines as they are;
- a rank whose sender raised anyway finishes the source's gathers
  (`PolicySource.finish_pass`);
- then the ranks exchange what failed, in one small all-gather over the actor's group
  (`agreed_verdict`), and each raises the same PushFailed, naming the actor rank and
  the engine (rollout rank, pool) and the call it failed in.

Why not only drain, as the host sender does: IPC's collectives (its handle all-gather,
its barriers) are vLLM's, between the source's items; rank 0 would have to replay them.
And a vote before each gather would need a hook inside vLLM's sender loop, and a
collective per tensor. Deferring keeps vLLM's collective order intact, and costs a push
that succeeds one all-gather of a None per rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from rlhf_trainer.rollout.transfer_engines import PolicySource, abort_sender
from rlhf_trainer.rollout.weight_sync import HOST_TRANSFER, EngineFanOut, TransferError

log = logging.getLogger(__name__)


class PushFailed(TransferError):
    """A weight push failed; the same error on every actor rank, naming the actor
    rank(s) where it failed, and why (an engine's failure names the engine)."""


class DeferredCalls:
    """vLLM's `VLLMWeightSyncClient` for its senders on the actor's rank 0: the engines'
    calls of a push through `engines`, the first failure kept (`take_failure`) instead
    of raised, and the calls after it skipped. Opening (`init_weight_transfer_engine`)
    raises as it is: it is no push."""

    def __init__(self, engines: EngineFanOut) -> None:
        self.engines = engines
        self.failure: Exception | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engines.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._call(self.engines.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        self._call(self.engines.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self.engines.finish_weight_update, weight_version)

    def _call(self, call: Callable[..., None], *args: Any) -> None:
        if self.failure is not None:
            return  # the push has failed: the engines are sent nothing more of it
        try:
            call(*args)
        except Exception as error:
            self.failure = error

    def take_failure(self) -> Exception | None:
        """The failure of the push that ended, if any; the next push starts clean."""
        failure, self.failure = self.failure, None
        return failure


class WeightPush:
    """One actor rank's side of the pushes to the engines over an open transfer:
    vLLM's trainer-side engine `transfer`, the policy `source` it gathers, and the
    `engines` (rank 0 drives them; `calls`: through DeferredCalls, for vLLM's senders)."""

    def __init__(
        self,
        transfer: TrainerWeightTransferEngine,
        source: PolicySource,
        engines: EngineFanOut,
        calls: DeferredCalls | None,
        rank: int,
    ) -> None:
        self.transfer, self.source = transfer, source
        self.engines, self.calls, self.rank = engines, calls, rank

    def send(self, version: int) -> None:
        """Hand the policy to every engine as `version`. A collective of the actor's
        ranks; if it fails anywhere, every rank raises the same PushFailed."""
        self.engines.version = version
        if self.calls is not None:  # vLLM's senders (ours says what its buckets hold)
            meta = self.source.metadata()
            self.engines.push_bytes = sum(math.prod(m.shape) * m.dtype.itemsize for m in meta)
        failure = self._send()
        verdict = agreed_verdict(failure, self.rank)
        if verdict is not None:
            raise PushFailed(f"the weight push of version {version} failed: {verdict}") from (
                failure
            )

    def _send(self) -> Exception | None:
        """This rank's part of the push, to the end of every collective; what failed."""
        raised = None
        try:
            self.transfer.send_weights()
        except Exception as error:
            raised = error
        finally:
            self.source.finish_pass()  # the gathers the sender left, if it raised
        deferred = self.calls.take_failure() if self.calls is not None else None
        return deferred or raised  # an engine's failure first: the rest follow from it

    def abort(self) -> None:
        """End this rank's side at once, from any thread (`abort_sender`): told by the
        engines' fan-out when a call fails, so that an NCCL broadcast waiting on that
        engine ends now."""
        log.warning("actor rank %d: an engine failed in the weight transfer; this rank's "
                    "end of it is aborted", self.rank)  # fmt: skip
        abort_sender(self.transfer)

    def shutdown(self) -> None:
        self.transfer.shutdown()


def open_push(info: TrainerInitInfo, engines: EngineFanOut, source: PolicySource) -> WeightPush:
    """Set up this rank's side of the transfer with vLLM's trainer-side factory (rank 0
    also the engines' side), on `info`'s backend; the engines' fan-out aborts it when a
    call fails."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    calls = None if info.backend == HOST_TRANSFER else DeferredCalls(engines)
    client = engines if calls is None else calls
    transfer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    push = WeightPush(transfer, source, engines, calls, info.rank)
    engines.on_failure = push.abort
    return push


def agreed_verdict(failure: Exception | None, rank: int) -> str | None:
    """What failed on each actor rank whose push failed, the same on every rank (a
    collective over the default group, the actor's); None when none failed."""
    mine = None if failure is None else f"actor rank {rank}: {failure}"
    verdicts: list[str | None] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, mine)
    failed = [verdict for verdict in verdicts if verdict is not None]
    return "; ".join(failed) if failed else None
