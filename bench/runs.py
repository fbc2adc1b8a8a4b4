"""One measured run of a job on a simulated local cluster, as the split and async benches
take it: the steps after the warm-up, and what their trace says (the mean step and
phase times, each pool's idle share, the driver's share)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.harness import Measurement
from bench.timeline import Trace
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter


def measure_run(
    job: Callable[[Path], JobConfig], warmup_steps: int
) -> tuple[list[StepResult], Measurement]:
    """Train `job(checkpoint_dir)`; the measured steps and their figures: step_s,
    driver_share, response_tokens (mean per sample), phase.<phase> (mean busy seconds a
    step) and idle.<pool>."""
    steps: list[StepResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        config, trace_path = job(Path(tmp) / "checkpoints"), Path(tmp) / "trace.json"
        with local_ray_cluster(config):
            run_job(config, "bench", ConsoleReporter(every=1e9), None, trace_path, steps.append)
        trace = Trace.load(trace_path)
        if keep := os.environ.get("BENCH_KEEP_TRACES"):  # a directory: each run's trace, kept
            shutil.copy(trace_path, Path(keep) / f"trace-{len(list(Path(keep).iterdir()))}.json")
    measured = steps[warmup_steps:]
    windows = trace.step_windows([s.seconds for s in measured])
    driver = trace.driver_shares(windows)
    phases = {
        f"phase.{phase}": sum(s.phase_seconds.get(phase, 0.0) for s in measured) / len(measured)
        for phase in Phase
        if any(phase in s.phase_seconds for s in measured)
    }
    return measured, {
        "step_s": sum(s.seconds for s in measured) / len(measured),
        "driver_share": sum(driver) / len(driver),
        "response_tokens": sum(s.response_tokens for s in measured)
        / (config.samples_per_step * len(measured)),
        **phases,
        **{f"idle.{p.name}": trace.idle_share(p.name, windows) for p in config.pools},
    }
