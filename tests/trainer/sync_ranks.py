"""The processes of the weight-transfer tests: the actor's rank 0 with the host
backend's trainer engine (`transfer_engines`), and two engines' receiving ends, one on
the sender's node (it reads the sender's parameters or ring) and one on "another node"
(it takes the buckets over gloo into a ring of its own).

The engines' side is what `EngineWorker` does around vLLM (`Relay`, `Segments`), with a
recorder in place of vLLM's loader. The sender reaches them through a client that
speaks vLLM's `VLLMWeightSyncClient` over pipes, as `cluster.engine_client` does over
Ray. Every function here runs in a child; results come back pickled.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.rollout.transfer_memory import Relay, Segments
from rlhf_trainer.rollout.weight_sync import Bucket, EngineFanOut, TransferSetup
from rlhf_trainer.worker import free_port

TINY = TinyModel(hidden_size=64, num_layers=3, num_heads=2, vocab_size=32)
ENGINES = 2
REMOTE = (1,)  # engine 1 is on another node than the sender; engine 0 beside it


def tiny_policy() -> tuple[torch.nn.Module, bool]:
    model = build_tiny_model(TINY)
    return model, bool(model.config.tie_word_embeddings)


def spawn(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run fn(rank, pipes, port, *args) in 1 + ENGINES processes (rank 0 the sender,
    rank 1 + i engine i); their results in rank order. An exception in any fails it."""
    pipes = [mp.Pipe() for _ in range(ENGINES)]
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as results:
        mp.spawn(
            _main,
            args=(fn, pipes, free_port(), Path(results), args),
            nprocs=1 + ENGINES,
            join=True,
        )
        return [
            torch.load(Path(results) / f"rank-{rank}.pt", weights_only=False)
            for rank in range(1 + ENGINES)
        ]


def _main(
    rank: int,
    fn: Callable[..., Any],
    pipes: list[tuple[Connection, Connection]],
    port: int,
    results: Path,
    args: tuple[Any],
) -> None:
    torch.set_num_threads(1)
    ends = [pipe[0] for pipe in pipes] if rank == 0 else [pipes[rank - 1][1]]
    torch.save(fn(rank, ends, port, *args), results / f"rank-{rank}.pt")


class PipeClient(EngineFanOut):
    """vLLM's `VLLMWeightSyncClient` over pipes: each call sent to every engine."""

    def __init__(self, engines: list[Connection]) -> None:
        self.engines = engines

    def close(self) -> None:
        self.wait(self.submit("close"))

    def submit(self, method: str, *args: Any) -> None:
        for engine in self.engines:
            engine.send((method, args))

    def answers(self, sent: None) -> None:
        for engine in self.engines:
            answer = engine.recv()
            if answer != "ok":
                raise RuntimeError(answer)


def send_versions(
    rank: int,
    ends: list[Connection],
    port: int,
    versions: list[float],
    bucket_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    remote: tuple[int, ...] = REMOTE,
) -> dict[str, Any]:
    """The sender pushes the tiny policy (fp32) scaled by each of `versions`, in
    `dtype`, to engines of which `remote` are on another node; an engine records what
    it loads. Rank 0 returns what it sent, its ring's size, and whether it wrote to it."""
    if rank != 0:
        return _engine(rank - 1, ends[0])
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rlhf_trainer.rollout.transfer_engines import PolicySource, trainer_init_info

    model, tied = tiny_policy()
    source = PolicySource(model, tied, dtype)
    setup = TransferSetup("127.0.0.1", port, ENGINES, remote, bucket_bytes, 60.0)
    client = PipeClient(ends)
    engine = WeightTransferTrainerFactory.trainer_init(
        trainer_init_info(0, setup), client=client, source=source
    )
    sent, originals = [], {n: p.detach().clone() for n, p in model.named_parameters()}
    for version, scale in enumerate(versions, start=1):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(originals[name] * scale)
        client.version = version
        engine.send_weights()
        sent.append({name: tensor.clone() for name, tensor in source})
    ring = engine.ring.segment.tensor
    out = {"sent": sent, "ring_bytes": ring.numel(), "ring_written": bool(ring.any())}
    out["plan"] = [bucket.names for bucket in engine.plan]
    out["ring"] = engine.ring.segment.name
    engine.shutdown()
    client.close()
    return out


def _engine(index: int, sender: Connection) -> dict[str, Any]:
    """One engine's receiving end: joins the gloo group if it is on another node, then
    loads each bucket from shared memory, recording what it got and where it lay."""
    relay: Relay | None = None
    segments = Segments()
    out: dict[str, Any] = {"loads": [], "versions": [], "segments": set(), "buckets": []}
    loaded: dict[str, Tensor] = {}
    while True:
        method, args = sender.recv()
        try:
            if method == "init_weight_transfer_engine":
                relay = Relay.join(args[0], index)
            elif method == "start_weight_update":
                loaded = {}
                out["buckets"].append([])
            elif method == "update_weights":
                bucket = Bucket.from_dict(args[0])
                if relay is not None:
                    bucket = relay.receive(bucket)
                out["segments"].add(bucket.segment)
                out["buckets"][-1].append(bucket.names)
                loaded.update((name, view.clone()) for name, view in segments.read(bucket))
            elif method == "finish_weight_update":
                out["loads"].append(loaded)
                out["versions"].append(args[0])
                segments.prune()
            elif method == "close":
                sender.send("ok")
                break
            sender.send("ok")
        except Exception as error:
            sender.send(f"engine {index}: {error!r}")
            raise
    out["relay_ring"] = relay.ring.segment.name if relay is not None else None
    if relay is not None:
        relay.close()
    return out
