"""Benchmark: what our machinery costs over the bare engines, in one run (issue 76).

    rollout   tokens/s of a fully-async job's rollout pool over vLLM's own
              `LLM.generate` on the same engine settings and requests (rollout.py)
    training  samples/s of the job's actor update over a bare FSDP2 loop on the same
              model, micro-batches and ranks (training.py)

One job (job.py) is started on a simulated local cluster and kept; the bare engines
run beside it, in processes of their own, each idle while the other side is measured.
The five variants (rollout.py, training.py: the job's rollout, `LLM`, `AsyncLLM` alone,
the job's update, bare FSDP2) are interleaved after one warm-up of each, and each ratio
is taken within a repeat; the rollout ratio is also split in two, our machinery over
`AsyncLLM` and `AsyncLLM` over `LLM`. The weight push into the idle engine is reported
apart (`train_job.push_s`). Beside each wall-clock ratio, the same in CPU-seconds
(`rollout_cpu`, `training_cpu`: every process of the job, this one, Ray's daemons and
actors, against the bare engine's), which a loaded machine changes least. The start-up
figures come from bench/overhead/startup.py when it is there, measured first, before
the job starts.

Run: make bench-overhead (a few minutes, and the start-up's). Arguments, all optional:
repeats, prompts per rollout measurement (samplesPerPrompt samples each), updates per
training measurement, start-up repeats (0: none).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness import Measurement, Variant, run_bench
from bench.overhead.cpu import tree_cpu_by_part, tree_cpu_seconds
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import open_run
from rlhf_trainer.telemetry.report import ConsoleReporter

from .job import ACTOR_RANKS, job
from .rollout import BareVLLM, JobRollout, requests_of
from .training import BareTorch, JobTraining, experience_of

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
PROMPTS = int(sys.argv[2]) if len(sys.argv) > 2 else 64
UPDATES = int(sys.argv[3]) if len(sys.argv) > 3 else 8
STARTUP_REPEATS = int(sys.argv[4]) if len(sys.argv) > 4 else 3  # 0: none (each ~1.5 min)


def compare(run: dict[str, Measurement]) -> Measurement:
    return {
        "rollout": run["rollout_job"]["tokens_per_s"] / run["rollout_vllm"]["tokens_per_s"],
        "rollout_cpu": run["rollout_job"]["tokens_per_cpu_s"]
        / run["rollout_vllm"]["tokens_per_cpu_s"],
        # the rollout ratio in two: our machinery over AsyncLLM, AsyncLLM over LLM
        "rollout_job_of_async_llm": run["rollout_job"]["tokens_per_s"]
        / run["rollout_async_llm"]["tokens_per_s"],
        "async_llm_of_llm": run["rollout_async_llm"]["tokens_per_s"]
        / run["rollout_vllm"]["tokens_per_s"],
        "rollout_job_of_async_llm_cpu": run["rollout_job"]["tokens_per_cpu_s"]
        / run["rollout_async_llm"]["tokens_per_cpu_s"],
        "training": run["train_job"]["samples_per_s"] / run["train_torch"]["samples_per_s"],
        "training_cpu": run["train_job"]["samples_per_cpu_s"]
        / run["train_torch"]["samples_per_cpu_s"],
    }


def startup_figures(repeats: int) -> dict[str, Any]:
    """bench/overhead/startup.py's figures, or why there are none."""
    if repeats == 0:
        return {"missing": "not measured (start-up repeats 0)"}
    try:
        startup = importlib.import_module("bench.overhead.startup")
    except ModuleNotFoundError as missing:
        if missing.name != "bench.overhead.startup":
            raise
        return {"missing": "bench/overhead/startup.py is not there: no start-up figures"}
    figures: dict[str, Any] = startup.measure_startup(repeats)
    return figures


def interleaved(
    rollout: JobRollout,
    bare_vllm: BareVLLM,
    bare_async_llm: BareVLLM,
    training: JobTraining,
    bare_torch: BareTorch,
) -> dict[str, Variant]:
    """The variants, in the order each repeat runs them: the bare engines generate what
    the job generated just before them."""

    def same_requests(engine: BareVLLM) -> Measurement:
        assert rollout.last is not None, "rollout_job runs first in each repeat"
        return engine.measure(rollout.last)

    return {
        "rollout_job": rollout.measure,
        "rollout_vllm": partial(same_requests, bare_vllm),
        "rollout_async_llm": partial(same_requests, bare_async_llm),
        "train_job": training.measure,
        "train_torch": bare_torch.measure,
    }


def main() -> None:
    startup = startup_figures(STARTUP_REPEATS)
    with tempfile.TemporaryDirectory() as tmp:
        config = job(Path(tmp) / "checkpoints")
        quiet = ConsoleReporter(every=1e9)
        with local_ray_cluster(config), open_run(config, "overhead", quiet) as run:
            run.start()
            assert run.streaming is not None, "a fully-async job"
            bare: list[int] = []  # the bare engines' processes: not the job's
            job_cpu = partial(tree_cpu_seconds, os.getpid(), bare)  # this process, Ray's, ...
            by_part = partial(tree_cpu_by_part, os.getpid(), bare)
            rollout = JobRollout(run.streaming, PROMPTS, by_part)
            first = rollout.first_samples()  # the engine's warm-up
            experience = experience_of(
                first[: config.samples_per_step], run.trainer.parts.tokens.pad_id
            )
            training = JobTraining(run.trainer, experience, UPDATES, job_cpu)
            bare_torch = BareTorch(config, experience, UPDATES, ACTOR_RANKS)
            bare_vllm = BareVLLM(config)  # last: it sets vLLM's environment here
            bare_async_llm = BareVLLM(config, "async_llm")
            processes = [*bare_torch.processes, bare_vllm.process, bare_async_llm.process]
            bare += [p.pid for p in processes if p.pid is not None]
            try:
                bare_vllm.measure(requests_of(run.streaming, first))  # their warm-ups
                bare_async_llm.measure(requests_of(run.streaming, first))
                training.measure()
                bare_torch.measure()
                variants = interleaved(rollout, bare_vllm, bare_async_llm, training, bare_torch)
                run_bench(
                    "overhead",
                    variants,
                    REPEATS,
                    compare,
                    samples_per_rollout=PROMPTS * config.generation.samples_per_prompt,
                    updates=UPDATES,
                    actor_ranks=ACTOR_RANKS,
                    samples_per_update=config.samples_per_step,
                    startup=startup,
                )
            finally:
                bare_torch.close()
                bare_vllm.close()
                bare_async_llm.close()


if __name__ == "__main__":
    main()
