"""Benchmark: what these 2 cores cost two ranks that compute at once, with no product code.

The split bench sees every phase run 1.1-1.3x slower beside the other pool than alone.
This bench asks how much of that is the machine: one process trains the split bench's
model, built as the trainer builds it (qwen2, hidden 256, 4 layers; a batch of 16 x 32
tokens, one torch thread, as each role rank has), alone, then two such processes train
at once. No Ray, no vLLM, no driver: slowdown = time side by side / time alone is the
machine's (shared caches, memory bandwidth, the hypervisor's scheduling of these vCPUs).

Interleaved (alone, side by side) 3 times by default; median and min-max. Run:
make bench-contention (about a minute). Argument, optional: repeats.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any

from bench.harness import Measurement, run_bench

ITERATIONS = 20
REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def train_seconds(barrier: Any, results: Any, iterations: int = ITERATIONS) -> None:
    """Put the seconds a forward-backward-step pass takes into `results`: timed over
    `iterations` passes after a warm-up one, from when every process is ready (the
    imports take seconds, and unsynchronised processes would barely overlap)."""
    import torch

    from bench.split_placement.run import MODEL
    from rlhf_trainer.api.sections import TinyModel
    from rlhf_trainer.models import build_tiny_model

    torch.set_num_threads(1)  # as each role rank (rlhf_trainer.worker.CPU_THREADS_PER_RANK)
    model = build_tiny_model(TinyModel.model_validate(MODEL)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, 64, (16, 32))
    for i in range(iterations + 1):
        if i == 1:
            barrier.wait()
            started = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    results.put((time.perf_counter() - started) / iterations)


def in_processes(count: int) -> list[float]:
    """Each of `count` processes' seconds a pass, timed from the same moment."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(count), context.Queue()
    processes = [
        context.Process(target=train_seconds, args=(barrier, results)) for _ in range(count)
    ]
    for process in processes:
        process.start()
    times = [results.get() for _ in processes]
    for process in processes:
        process.join()
    return times


def alone() -> Measurement:
    return {"pass_s": in_processes(1)[0]}


def side_by_side() -> Measurement:
    times = in_processes(2)
    return {"pass_s": sum(times) / len(times)}


def compare(run: dict[str, Measurement]) -> Measurement:
    return {"slowdown": run["side_by_side"]["pass_s"] / run["alone"]["pass_s"]}


def main() -> None:
    run_bench(
        "contention",
        {"alone": alone, "side_by_side": side_by_side},
        REPEATS,
        compare,
        iterations=ITERATIONS,
    )


if __name__ == "__main__":
    main()
