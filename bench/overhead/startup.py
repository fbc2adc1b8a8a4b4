"""Start-up: how long `rlhfjob train examples/local-cpu.yaml` takes to its first step,
against the bare imports of torch, vLLM and Ray, each in a fresh process, summed.

    first_step  `rlhfjob train --cpu --steps 1` (as `make demo` runs it) in a fresh run
                folder: seconds from the launch until the run starts its first step
                (`start_s`: the first line of metrics.jsonl less the step's own seconds,
                which hold vLLM's first, slow generate), and the CPU-seconds every process
                of the run had used when that line appeared (`start_cpu_s`, the step's
                included: the tree's CPU is read when the line is seen), the driver's
                own among them (`driver_cpu_s`), and seconds to the run's end (`run_s`)
    imports     `python -c "import torch"`, then vllm, then ray, each in a fresh process:
                wall and CPU seconds, summed (vLLM's import includes torch's)

CPU-seconds are the fairer figure on a shared machine: wall time grows with whatever
else runs; the CPU a run spends does much less. `before` (a checkout of another commit,
e.g. `git worktree add /tmp/before HEAD~1`) runs the same first step on that commit's
code with this .venv, interleaved with this checkout's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

from bench.harness import Measurement, Variant, figures, interleave

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = Path("examples/local-cpu.yaml")
CLI = "import sys; from rlhf_operator.app.cli import main; sys.exit(main())"
BARE_IMPORTS = ("torch", "vllm", "ray")
FIRST_STEP_TIMEOUT_S = 600.0
POLL_S = 0.05


def first_step(checkout: Path = REPO) -> Measurement:
    """One local run of the example in `checkout` (its code, this interpreter), to its
    first step and on to its end; seconds and CPU-seconds (see the module's doc)."""
    code = [checkout / "trainer_image", checkout / "operator"]  # ahead of the editable install
    env = os.environ | {"PYTHONPATH": os.pathsep.join(map(str, code))}
    with tempfile.TemporaryDirectory(prefix="startup-") as run_dir:
        metrics = Path(run_dir) / "metrics.jsonl"
        command = [sys.executable, "-c", CLI, "train", "--cpu", "--steps", "1",
                   "--run-dir", run_dir, str(checkout / EXAMPLE)]  # fmt: skip
        log = Path(run_dir) / "run.log"  # the run's output: its tail, if it fails
        started = time.monotonic()
        with log.open("w") as output:
            run = psutil.Popen(command, cwd=run_dir, env=env, stdout=output, stderr=output)
        try:
            line, cpu = first_line(run, metrics)
        except (RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"{error}; its output ends:\n{log.read_text()[-2000:]}") from None
        to_line_s = time.monotonic() - started
        status = run.wait()
        total_s = time.monotonic() - started
        if status != 0:
            raise RuntimeError(
                f"rlhfjob train in {checkout}: status {status}\n{log.read_text()[-2000:]}"
            )
    step_s = float(json.loads(line)["seconds"])
    return {
        "start_s": to_line_s - step_s,
        "first_step_s": step_s,
        **cpu,
        "run_s": total_s,  # to its end: the step, the held-out answers, the export
    }


def first_line(run: psutil.Popen, metrics: Path) -> tuple[str, Measurement]:
    """The first line of `metrics` once written, and the CPU-seconds `run` and every
    process under it (Ray's, the workers') have used by then (`tree_cpu_s`)."""
    deadline = time.monotonic() + FIRST_STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise RuntimeError(f"the run ended (status {run.returncode}) before its first step")
        text = metrics.read_text() if metrics.exists() else ""
        if text.endswith("\n"):
            return text.splitlines()[0], tree_cpu_s(run)
        time.sleep(POLL_S)
    run.kill()
    raise TimeoutError(f"no first step in {FIRST_STEP_TIMEOUT_S:.0f} s")


def tree_cpu_s(root: psutil.Process) -> Measurement:
    """CPU-seconds of `root` and its live descendants, with what each has collected of
    its children that ended (a worker that exited counts in its raylet's): all of them
    (`start_cpu_s`), and the driver's own (`driver_cpu_s`, `python -m rlhf_trainer`:
    its part is spent before the roles start, in series with everything else)."""
    total = driver = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            command = process.cmdline()
        except psutil.NoSuchProcess:
            continue  # ended just now: its parent collects it
        total += times.user + times.system + times.children_user + times.children_system
        if command[1:3] == ["-m", "rlhf_trainer"]:
            driver = times.user + times.system
    return {"start_cpu_s": total, "driver_cpu_s": driver}


def bare_imports() -> Measurement:
    """Each of BARE_IMPORTS in a fresh process of this interpreter: seconds and CPU-seconds."""
    measured: Measurement = {}
    for module in BARE_IMPORTS:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
        measured[f"{module}_s"] = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        measured[f"{module}_cpu_s"] = cpu
    measured["sum_s"] = sum(measured[f"{m}_s"] for m in BARE_IMPORTS)
    measured["sum_cpu_s"] = sum(measured[f"{m}_cpu_s"] for m in BARE_IMPORTS)
    return measured


def compare(run: dict[str, Measurement]) -> Measurement:
    """Within a repeat: the start over the bare imports' sum, and after over before."""
    ratios = {
        "start_over_imports": run["first_step"]["start_s"] / run["imports"]["sum_s"],
        "start_cpu_over_imports": run["first_step"]["start_cpu_s"] / run["imports"]["sum_cpu_s"],
    }
    if "before" in run:
        for figure in ("start_s", "start_cpu_s", "driver_cpu_s", "run_s"):
            ratios[f"after_over_before.{figure}"] = (
                run["first_step"][figure] / run["before"][figure]
            )
    return ratios


def measure_startup(
    repeats: int, before: Path | None = None, checkout: Path = REPO
) -> dict[str, Any]:
    """The start-up figures over `repeats` interleaved repeats (median, min, max) of the
    code in `checkout` (this one's, by default); with `before`, that checkout's first
    step too, and after/before ratios."""
    variants: dict[str, Variant] = {
        "imports": bare_imports,
        "first_step": bind(first_step, checkout.resolve()),
    }
    if before is not None:
        variants["before"] = bind(first_step, before.resolve())
    spreads = figures(interleave(variants, repeats), compare)
    return {
        "bench": "startup",
        "repeats": repeats,
        "example": str(EXAMPLE),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],  # a shared machine: what else was running
        "figures": {key: spread.to_json() for key, spread in spreads.items()},
    }


def bind(variant: Callable[[Path], Measurement], checkout: Path) -> Variant:
    return lambda: variant(checkout)


if __name__ == "__main__":
    # python -m bench.overhead.startup [REPEATS [BEFORE_CHECKOUT [AFTER_CHECKOUT]]]
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    before = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    checkout = Path(sys.argv[3]) if len(sys.argv) > 3 else REPO
    print(json.dumps(measure_startup(repeats, before, checkout)))
