"""Weight sync between two processes on one GPU (an engine beside the actor on its pool):
the host-memory broadcast the trainer uses there, against CUDA IPC and a device memcpy.

    host      `weight_sync.send_weights`/`receive_weights` on a gloo group (`sync_device
              ("host")`): GPU -> host buffer -> loopback -> host buffer -> the receiver's GPU
    cuda_ipc  the sender's bucket buffer shared once through a CUDA IPC handle; per
              bucket, the sender fills it and signals, the receiver copies it into its
              own GPU tensors and acknowledges (the gloo group carries only the signals)
    memcpy    one device-to-device copy of as many bytes, in one process: the bound

NCCL refuses two ranks on one device, hence these. Needs a CUDA GPU and torch only
(no Ray, no vLLM): `PYTHONPATH=trainer_image python -m bench.weight_sync.same_device`.
Variants are interleaved, 5 repeats, median and min-max, as one JSON line.
"""

from __future__ import annotations

import json
import pickle
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

from rlhf_trainer.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    SyncGroup,
    WeightSpec,
    plan_buckets,
    receive_weights,
    send_weights,
    sync_device,
    weight_specs,
)

REPEATS = 5
TENSORS, ROWS, COLUMNS = 40, 2048, 1024  # 40 fp32 tensors of 8 MiB: 336 MB


def free_port() -> int:
    """(rlhf_trainer.worker's, which would import pydantic: the GPU machine has torch only.)"""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def weights() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.randn(ROWS, COLUMNS, device="cuda") for i in range(TENSORS)}


def send_bytes(group: SyncGroup, payload: bytes) -> None:
    group.broadcast(torch.tensor([len(payload)], dtype=torch.int64))
    group.broadcast(torch.tensor(list(payload), dtype=torch.uint8))


def receive_bytes(group: SyncGroup) -> bytes:
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast(length)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    group.broadcast(payload)
    return bytes(payload.tolist())


def ipc_transfer(
    group: SyncGroup,
    specs: Sequence[WeightSpec],
    buffer: torch.Tensor,
    fill: Callable[[torch.Tensor, WeightSpec], None],
) -> None:
    """Both sides: for each bucket, the sender `fill`s the shared buffer and signals; the
    receiver `fill`s (copies out) and acknowledges, so the next bucket may overwrite it."""

    def fill_bucket(bucket: Sequence[WeightSpec]) -> None:
        offset = 0
        for spec in bucket:
            fill(buffer[offset : offset + spec.nbytes], spec)
            offset += spec.nbytes
        torch.cuda.synchronize()

    for bucket in plan_buckets(specs, DEFAULT_BUCKET_BYTES):
        if group.is_sender:
            fill_bucket(bucket)
        group.broadcast(torch.zeros(1))  # the bucket is ready
        if not group.is_sender:
            fill_bucket(bucket)
        group.all_agree(True)  # the receiver has copied it out


def rank_main(rank: int, port: int, results: Any) -> None:
    torch.cuda.set_device(0)
    group = SyncGroup.create("127.0.0.1", port, rank, 2, sync_device("host"))
    torch.manual_seed(0)  # the same weights on both sides, to check what arrived
    source = weights()
    specs = weight_specs(source)
    into = {name: torch.empty_like(t) for name, t in source.items()}
    if rank == 0:
        buffer = torch.empty(DEFAULT_BUCKET_BYTES, dtype=torch.uint8, device="cuda")
        send_bytes(group, pickle.dumps(reduce_tensor(buffer)))
    else:
        rebuild, args = pickle.loads(receive_bytes(group))
        buffer = rebuild(*args)

    def put(view: torch.Tensor, spec: WeightSpec) -> None:
        view.view(spec.dtype).view(spec.shape).copy_(source[spec.name])

    def take(view: torch.Tensor, spec: WeightSpec) -> None:
        into[spec.name].copy_(view.view(spec.dtype).view(spec.shape))

    def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, view in bucket:
            into[name].copy_(view)

    def host() -> None:
        if rank == 0:
            send_weights(group, source)
        else:
            receive_weights(group, specs, DEFAULT_BUCKET_BYTES, load)

    flat = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device="cuda")
    other = torch.empty_like(flat)
    variants: dict[str, Callable[[], None]] = {
        "host": host,
        "cuda_ipc": lambda: ipc_transfer(group, specs, buffer, put if rank == 0 else take),
        "memcpy": lambda: flat.copy_(other),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(REPEATS + 1):  # the first round warms up
        for name, run in variants.items():
            group.all_agree(True)
            started = time.perf_counter()
            run()
            torch.cuda.synchronize()
            if repeat:
                seconds[name].append(time.perf_counter() - started)
    if rank == 1:
        for variant in ("host", "cuda_ipc"):  # each must deliver every weight exactly
            for tensor in into.values():
                tensor.zero_()
            group.all_agree(True)
            variants[variant]()
            assert all(torch.equal(into[n], source[n]) for n in source), variant
        results.put(seconds)
    else:
        for variant in ("host", "cuda_ipc"):
            group.all_agree(True)
            variants[variant]()
    group.all_agree(True)
    group.close()


def main() -> dict[str, Any]:
    nbytes = TENSORS * ROWS * COLUMNS * 4
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(rank_main, args=(free_port(), results), nprocs=2, join=True)
    seconds: dict[str, list[float]] = results.get()
    memcpy = nbytes / statistics.median(seconds["memcpy"]) / 1e9
    out: dict[str, Any] = {"bench": "weight_sync_same_device", "megabytes": nbytes // 10**6}
    out["device"] = torch.cuda.get_device_name(0)
    for name, times in seconds.items():
        gbps = nbytes / statistics.median(times) / 1e9
        out[name] = {
            "seconds_median": round(statistics.median(times), 4),
            "seconds_min": round(min(times), 4),
            "seconds_max": round(max(times), 4),
            "gb_per_s": round(gbps, 2),
            "ratio_to_memcpy": round(gbps / memcpy, 4),
        }
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
