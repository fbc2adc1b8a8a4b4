"""The job's rollout measurement of bench-overhead alone, repeated, for a profiler to
attach to (`py-spy record -p PID` on the rollout rank, the queue actor, the driver):
`python -m bench.overhead.rollout_loop [measurements] [prompts]`. Prints each part's
CPU-seconds a measurement (bench/overhead/cpu.py's PARTS), median over the measurements,
and the processes' ids by part on stderr as soon as the job is up."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

from bench.overhead.cpu import engine_parents, part_of, tree_cpu_by_part, tree_processes
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import open_run
from rlhf_trainer.telemetry.report import ConsoleReporter

from .job import job
from .rollout import JobRollout

MEASUREMENTS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
PROMPTS = int(sys.argv[2]) if len(sys.argv) > 2 else 64


def pids_by_part() -> dict[str, list[int]]:
    parts: dict[str, list[int]] = {}
    processes = tree_processes(os.getpid(), ())
    rollout_ranks = engine_parents(processes)
    for process in processes:
        parts.setdefault(part_of(process, os.getpid(), rollout_ranks), []).append(process.pid)
    return parts


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = job(Path(tmp) / "checkpoints")
        with (
            local_ray_cluster(config),
            open_run(config, "overhead", ConsoleReporter(every=1e9)) as run,
        ):
            run.start()
            assert run.streaming is not None, "a fully-async job"
            rollout = JobRollout(run.streaming, PROMPTS, partial(tree_cpu_by_part, os.getpid(), ()))
            rollout.first_samples()
            print("PIDS " + json.dumps(pids_by_part()), file=sys.stderr, flush=True)
            runs = [rollout.measure() for _ in range(MEASUREMENTS)]
            figures = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(json.dumps({"measurements": MEASUREMENTS, **figures}))


if __name__ == "__main__":
    main()
