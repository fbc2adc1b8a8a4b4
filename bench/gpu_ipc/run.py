"""Benchmark: CUDA IPC between two processes on one GPU, what vLLM's IPC weight transfer
does when the engine shares the actor's GPU: the actor's process shares a buffer (a CUDA
IPC handle), the engine's process opens it and copies out of it into its own memory.

    local      the receiving process copies a buffer of its own (device to device): the ceiling
    ipc        it copies out of the sender's buffer, through a handle opened once
    ipc_fresh  the sender shares a new buffer and the receiver opens its handle, then
               copies: a push whose buckets are new allocations

GB/s counts the bytes copied once (a copy reads and writes each: the device moves twice
that); `ipc_share` is ipc's GB/s over local's in the same repeat. Each buffer holds 1 GiB,
about a 0.5B-parameter policy in bf16, of random bytes, and every copy is checked against
the sender's checksum. Copies are timed with CUDA events, the median of COPIES.

With torch alone: `PYTHONPATH=trainer_image python -m bench.gpu_ipc.run` (`make
bench-gpu-ipc`). Without a GPU it says so and measures nothing: a CPU has no CUDA IPC."""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from bench.harness import Measurement, run_bench

REPEATS = 5
COPIES = 20
BUFFER_BYTES = 1 << 30

_opened: dict[str, Any] = {}  # in the receiver: the buffers it holds


def checksum(buffer: torch.Tensor) -> int:
    return int(buffer[:: 1 << 16].to(torch.int64).sum())


def copy_seconds(source: torch.Tensor, target: torch.Tensor) -> float:
    """The median seconds of one copy of `source` into `target`, over COPIES."""
    times = []
    for _ in range(COPIES):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(statistics.median(times))


def receive(kind: str, shared: tuple[Any, ...] | None, expected: int) -> Measurement:
    """In the receiving process: copy from `kind`'s source into a buffer of its own."""
    if not _opened:  # made once: setdefault would allocate 2 GiB a call to throw away
        _opened["target"] = torch.empty(BUFFER_BYTES, dtype=torch.uint8, device="cuda")
        _opened["local"] = torch.randint(0, 256, (BUFFER_BYTES,), dtype=torch.uint8, device="cuda")
    target = _opened["target"]
    figures: Measurement = {}
    if kind == "local":
        source = _opened["local"]
        expected = checksum(source)
    else:
        assert shared is not None
        rebuild, args = shared
        started = time.perf_counter()
        source = rebuild(*args)  # cudaIpcOpenMemHandle, the first time this handle is seen
        torch.cuda.synchronize()
        figures["open_s"] = time.perf_counter() - started
    target.zero_()
    seconds = copy_seconds(source, target)
    if checksum(target) != expected:
        raise AssertionError(f"{kind}: the copy differs from its source")
    return figures | {"gb_per_s": BUFFER_BYTES / seconds / 1e9, "copy_ms": seconds * 1e3}


class Sender:
    """The sending process (this one): its buffers, and one receiving process."""

    def __init__(self) -> None:
        self.receiver = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
        self.kept = self.new_buffer()
        self.kept_handle = reduce_tensor(self.kept)  # type: ignore[no-untyped-call]
        self.fresh: list[torch.Tensor] = []  # alive while the receiver may hold them

    @staticmethod
    def new_buffer() -> torch.Tensor:
        return torch.randint(0, 256, (BUFFER_BYTES,), dtype=torch.uint8, device="cuda")

    def run(self, kind: str) -> Measurement:
        if kind == "local":
            return self.receiver.submit(receive, kind, None, 0).result()
        if kind == "ipc":
            return self.receiver.submit(
                receive, kind, self.kept_handle, checksum(self.kept)
            ).result()
        buffer = self.new_buffer()
        self.fresh = [buffer]
        started = time.perf_counter()
        handle = reduce_tensor(buffer)  # type: ignore[no-untyped-call]  # cudaIpcGetMemHandle
        share_s = time.perf_counter() - started
        figures = self.receiver.submit(receive, kind, handle, checksum(buffer)).result()
        return figures | {"share_s": share_s}


def compare(run: dict[str, Measurement]) -> Measurement:
    return {"ipc_share": run["ipc"]["gb_per_s"] / run["local"]["gb_per_s"]}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("device: no GPU; CUDA IPC needs one, so nothing was measured")
        print(json.dumps({"bench": "gpu_ipc", "device": "no GPU", "figures": {}}))
        raise SystemExit(0)
    device = torch.cuda.get_device_name()
    print(
        f"device: {device}; buffer {BUFFER_BYTES / 2**30:.0f} GiB, {COPIES} copies timed",
        flush=True,
    )
    sender = Sender()
    variants = {kind: (lambda k=kind: sender.run(k)) for kind in ("local", "ipc", "ipc_fresh")}
    run_bench("gpu_ipc", variants, REPEATS, compare, device=device, buffer_bytes=BUFFER_BYTES)
    sender.receiver.shutdown()
