"""Weight sync: how long handing a policy of a few hundred MB to a rollout engine takes,
by each transport the trainer has, against this machine's memcpy bandwidth.

    broadcast     both modes: the bucketed broadcast over a process group of its own
                  (`rollout.weight_sync`, gloo on CPU), the receiver copying every bucket
                  out, as every rollout worker does before loading (`receive_copies`)
    object_store  what synchronous mode did before, kept for comparison: actor rank 0
                  serialises the state dict to safetensors bytes, Ray's object store
                  carries them, the engine side deserialises them
    memcpy        one torch copy of as many bytes, in one process: the bound

The receiving side is a Ray actor in another process, as an engine is. The engine's own
load (vLLM's `reload_weights`) is left out: it is the same for every transport. Variants
are interleaved (A B A B ...) and each is reported as median and min-max, in GB/s and as
a share of memcpy's GB/s in the same repeat. `make bench-weight-sync`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from bench.harness import Measurement, run_bench
from rlhf_trainer.rollout.engine_weights import deserialize_weights, serialize_weights
from rlhf_trainer.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    SyncGroup,
    WeightSpec,
    receive_copies,
    send_weights,
    weight_specs,
)
from rlhf_trainer.worker import free_port

REPEATS = 5


def policy_weights() -> dict[str, torch.Tensor]:
    """A qwen2 of about 325 MB in fp32, built from a config (no download)."""
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    return {
        n: t.detach().contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"
    }


class Receiver:
    """The engine's side, in a process of its own."""

    def open(self, host: str, port: int) -> None:
        self.group = SyncGroup.create(host, port, rank=1, world_size=2)

    def receive(self, specs: list[WeightSpec]) -> int:
        kept = receive_copies(self.group, specs, DEFAULT_BUCKET_BYTES)
        return sum(t.nbytes for _, t in kept)

    def load(self, payload: bytes) -> int:
        return sum(t.nbytes for t in deserialize_weights(payload).values())


def timed(run: Callable[[], Any]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    weights = policy_weights()
    nbytes = sum(t.nbytes for t in weights.values())
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        receiver: Any = ray.remote(Receiver).options(num_cpus=0).remote()
        host, port = "127.0.0.1", free_port()
        opened = receiver.open.remote(host, port)
        group = SyncGroup.create(host, port, rank=0, world_size=2)
        ray.get(opened)
        specs = weight_specs(weights)
        flat = torch.empty(nbytes, dtype=torch.uint8)
        source = torch.empty_like(flat).random_(0, 255)

        def object_store() -> None:
            ref = ray.put(serialize_weights(weights))
            assert ray.get(receiver.load.remote(ref)) == nbytes

        def broadcast() -> None:
            received = receiver.receive.remote(specs)
            send_weights(group, weights, DEFAULT_BUCKET_BYTES)
            assert ray.get(received) == nbytes

        def variant(run: Callable[[], Any]) -> Callable[[], Measurement]:
            run()  # warm-up: first allocations, connections

            def measure() -> Measurement:
                seconds = timed(run)
                return {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}

            return measure

        variants = {
            "broadcast": variant(broadcast),
            "object_store": variant(object_store),
            "memcpy": variant(lambda: flat.copy_(source)),
        }

        def of_memcpy(run: dict[str, Measurement]) -> Measurement:
            memcpy = run["memcpy"]["gb_per_s"]
            return {
                f"{name}_of_memcpy": run[name]["gb_per_s"] / memcpy
                for name in run
                if name != "memcpy"
            }

        run_bench("weight_sync", variants, REPEATS, of_memcpy, megabytes=round(nbytes / 1e6))
        group.close()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
