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
a share of memcpy's GB/s. `make bench-weight-sync`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

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


def main() -> dict[str, Any]:
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

        variants = {
            "broadcast": broadcast,
            "object_store": object_store,
            "memcpy": lambda: flat.copy_(source),
        }
        for run in variants.values():
            run()  # warm-up: first allocations, connections
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(REPEATS):
            for name, run in variants.items():
                seconds[name].append(timed(run))
        group.close()
    finally:
        ray.shutdown()
    memcpy_gbps = nbytes / statistics.median(seconds["memcpy"]) / 1e9
    result: dict[str, Any] = {
        "bench": "weight_sync",
        "megabytes": round(nbytes / 1e6),
        "repeats": REPEATS,
    }
    print(f"{'transport':<14}{'median s':>10}{'min-max s':>16}{'GB/s':>8}{'of memcpy':>11}")
    for name, times in seconds.items():
        median = statistics.median(times)
        gbps = nbytes / median / 1e9
        result[name] = {
            "seconds_median": round(median, 4),
            "seconds_min": round(min(times), 4),
            "seconds_max": round(max(times), 4),
            "gb_per_s": round(gbps, 3),
            "ratio_to_memcpy": round(gbps / memcpy_gbps, 4),
        }
        span = f"{min(times):.3f}-{max(times):.3f}"
        print(f"{name:<14}{median:>10.3f}{span:>16}{gbps:>8.2f}{gbps / memcpy_gbps:>11.3f}")
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
