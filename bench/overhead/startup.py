"""Start-up: how long `rlhfjob train examples/local-cpu.yaml` takes to its first step,
against the bare imports of torch, vLLM and Ray, each in a fresh process, summed.

    first_step  `rlhfjob train --cpu --steps 2` (as `make demo` runs it) in a fresh run
                folder: seconds from the launch until the run starts its first step
                (`start_s`: the first line of metrics.jsonl less the step's own seconds,
                which hold vLLM's first, slow generate), and the CPU-seconds every process
                of the run had used when that line appeared (`start_cpu_s`, the step's
                included: the tree's CPU is read when the line is seen). Two steps, so
                that the line is the first step's alone: a run's last step writes its
                line after its held-out answers, checkpoint and export, and its roles
                stop right after (the actor's process often gone when the tree is read).
                The driver's own among them (`driver_cpu_s`), and seconds to the run's
                end (`run_s`);
                the CPU-seconds split by the kind of process (`cpu_s.<kind>`, `kind_of`:
                the driver, Ray's daemons, each role's ranks, vLLM's engine core) and how
                many processes of each kind there were (`processes.<kind>`)
    imports     `python -c "import torch"`, then vllm, then ray, each in a fresh process:
                wall and CPU seconds, summed (vLLM's import includes torch's)

CPU-seconds are the fairer figure on a shared machine: wall time grows with whatever
else runs; the CPU a run spends does much less. `before` (a checkout of another commit,
e.g. `git worktree add /tmp/before HEAD~1`) runs the same first step on that commit's
code with this .venv, interleaved with this checkout's.

What each process imports is found apart, once, not in the bench's loop (timing every
import costs a little in every process): `python -m bench.overhead.startup imports
[CHECKOUT]` runs the example to its first step with each of its Python processes
recording its imports (`record_imports`), and prints, per process, its kind, its
CPU-seconds and its imports', the heavy modules it holds (WATCHED) with their import's
CPU-seconds and the chain of imports that brought each in.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import psutil  # type: ignore[import-untyped]

from bench.harness import Measurement, Variant, figures, interleave
from bench.overhead.cpu import tree_processes

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = Path("examples/local-cpu.yaml")
CLI = "import sys; from rlhf_operator.app.cli import main; sys.exit(main())"
BARE_IMPORTS = ("torch", "vllm", "ray")
STEPS = 2  # the first step's line, written while every process of the run lives
FIRST_STEP_TIMEOUT_S = 600.0
POLL_S = 0.05
T = TypeVar("T")

# A run's processes by what they are (`kind_of`). Ray's daemons by their program: the GCS,
# and a raylet and its two agents a node; a Ray worker by the actor it hosts, as the
# actor names itself in the worker's log (a RankHost by its role, the fully-async queue
# as "queue"); a worker's children by what they are (vLLM's engine core) or whose they are.
RAY_PROGRAMS = {"gcs_server": "gcs", "raylet": "raylet"}
RAY_SCRIPTS = {  # by their script, or by the title they give themselves
    "ray::DashboardAgent": "dashboard_agent",
    "ray::RuntimeEnvAgent": "runtime_env_agent",
    "dashboard/agent.py": "dashboard_agent",
    "runtime_env/agent/main.py": "runtime_env_agent",
    "dashboard/dashboard.py": "dashboard",
    "log_monitor.py": "log_monitor",
    "autoscaler/_private/monitor.py": "autoscaler",
}
# Ray writes ":actor_name:<the actor's repr>" into its worker's log files once the actor
# is built; RankHost's repr is "RankHost(<role> rank <n>)".
ACTOR_NAME = re.compile(r"^:actor_name:(\w+)(?:\((\w+) rank \d+\))?$", re.MULTILINE)
ACTOR_KINDS = {"SampleQueue": "queue"}


def first_step(checkout: Path = REPO) -> Measurement:
    """One local run of the example in `checkout` (its code, this interpreter), to its
    first step and on to its end; seconds and CPU-seconds (see the module's doc)."""
    line, cpu, to_line_s, total_s = run_example(checkout, {}, tree_cpu_s)
    step_s = float(json.loads(line)["seconds"])
    return {
        "start_s": to_line_s - step_s,
        "first_step_s": step_s,
        **cpu,
        "run_s": total_s,  # to its end: the step, the held-out answers, the export
    }


def run_example(
    checkout: Path,
    environment: dict[str, str],
    at_first_step: Callable[[psutil.Popen], T],
    pythonpath: Iterable[Path] = (),
) -> tuple[str, T, float, float]:
    """`rlhfjob train --cpu --steps 2` of the example in `checkout` (its code ahead of
    the editable install, then `pythonpath`), in a fresh run folder, with `environment`
    added: the first line of its metrics, what `at_first_step` found of the run once
    that line was written, and the seconds to that line and to the run's end."""
    code = [checkout / "trainer_image", checkout / "operator", *pythonpath]
    env = os.environ | environment | {"PYTHONPATH": os.pathsep.join(map(str, code))}
    with tempfile.TemporaryDirectory(prefix="startup-") as run_dir:
        metrics = Path(run_dir) / "metrics.jsonl"
        command = [sys.executable, "-c", CLI, "train", "--cpu", "--steps", str(STEPS),
                   "--run-dir", run_dir, str(checkout / EXAMPLE)]  # fmt: skip
        log = Path(run_dir) / "run.log"  # the run's output: its tail, if it fails
        started = time.monotonic()
        with log.open("w") as output:
            run = psutil.Popen(command, cwd=run_dir, env=env, stdout=output, stderr=output)
        try:
            line = first_line(run, metrics)
            to_line_s = time.monotonic() - started
            found = at_first_step(run)
        except (RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"{error}; its output ends:\n{log.read_text()[-2000:]}") from None
        status = run.wait()
        total_s = time.monotonic() - started
        if status != 0:
            raise RuntimeError(
                f"rlhfjob train in {checkout}: status {status}\n{log.read_text()[-2000:]}"
            )
    return line, found, to_line_s, total_s


def first_line(run: psutil.Popen, metrics: Path) -> str:
    """The first line of `metrics`, once written."""
    deadline = time.monotonic() + FIRST_STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise RuntimeError(f"the run ended (status {run.returncode}) before its first step")
        text = metrics.read_text() if metrics.exists() else ""
        if text.endswith("\n"):
            return text.splitlines()[0]
        time.sleep(POLL_S)
    run.kill()
    raise TimeoutError(f"no first step in {FIRST_STEP_TIMEOUT_S:.0f} s")


def tree_cpu_s(root: psutil.Process) -> Measurement:
    """CPU-seconds of `root` and its live descendants, each with what it collected of
    its children that ended (a worker that exited counts in its raylet's): all of them
    (`start_cpu_s`), the driver's own (`driver_cpu_s`, `python -m rlhf_trainer`: its
    part is spent before the roles start, in series with everything else), and by kind
    of process (`cpu_s.<kind>`, `processes.<kind>`: how many)."""
    measured: Measurement = {"start_cpu_s": 0.0, "driver_cpu_s": 0.0}
    for process, kind in run_processes(root).items():
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue  # ended just now: its parent collects it
        own = times.user + times.system
        cpu = own + times.children_user + times.children_system
        measured["start_cpu_s"] += cpu
        measured[f"cpu_s.{kind}"] = measured.get(f"cpu_s.{kind}", 0.0) + cpu
        measured[f"processes.{kind}"] = measured.get(f"processes.{kind}", 0) + 1
        if kind == "driver":
            measured["driver_cpu_s"] = own
    return measured


def run_processes(root: psutil.Process) -> dict[psutil.Process, str]:
    """`root` and its live descendants, each with its kind (`kind_of`)."""
    commands: dict[int, tuple[psutil.Process, int, list[str]]] = {}
    for process in tree_processes(root.pid, ()):
        try:
            commands[process.pid] = (process, process.ppid(), process.cmdline())
        except psutil.NoSuchProcess:
            continue
    log_dir = ray_log_dir(command for _, _, command in commands.values())
    kinds: dict[int, str] = {}

    def kind(pid: int) -> str:
        if pid not in kinds:
            _, ppid, command = commands[pid]
            parent = None if pid == root.pid else kind(ppid) if ppid in commands else "other"
            actor = worker_actor(log_dir, pid) if log_dir and is_ray_worker(command) else None
            kinds[pid] = kind_of(command, parent, actor)
        return kinds[pid]

    return {process: kind(pid) for pid, (process, _, _) in commands.items()}


def kind_of(command: list[str], parent: str | None, actor: str | None = None) -> str:
    """What a run's process is, by its command line (a Ray worker's is its title,
    "ray::<class>.<method>"), its parent's kind (None: the run's root, the `rlhfjob`
    CLI) and, for a Ray worker, the actor its log names (`worker_actor`)."""
    line = " ".join(command)
    program = Path(command[0]).name if command else ""
    if parent is None:
        return "cli"
    if command[1:3] == ["-m", "rlhf_trainer"]:
        return "driver"
    if program in RAY_PROGRAMS:
        return RAY_PROGRAMS[program]
    for script, kind in RAY_SCRIPTS.items():
        if script in line:
            return kind
    if is_ray_worker(command):
        return actor or ("idle_worker" if "IDLE" in line else "ray_worker")
    if "EngineCore" in line:
        return "engine_core"
    return parent if parent.endswith(".child") else f"{parent}.child"


def is_ray_worker(command: list[str]) -> bool:
    return bool(command) and command[0].startswith("ray::")


def ray_log_dir(commands: Iterable[list[str]]) -> Path | None:
    """The run's Ray session's log folder, as its raylets were told it."""
    for command in commands:
        for argument in command:
            if argument.startswith("--log_dir=") and Path(command[0]).name == "raylet":
                return Path(argument.removeprefix("--log_dir="))
    return None


def worker_actor(log_dir: Path, pid: int) -> str | None:
    """The kind of the actor the Ray worker `pid` hosts, by the last name its log gives
    it: a RankHost's role, ACTOR_KINDS' name, or the class's name in lower case."""
    for log in log_dir.glob(f"worker-*-{pid}.out"):
        names: list[tuple[str, str]] = ACTOR_NAME.findall(log.read_text(errors="replace"))
        if names:
            class_name, role = names[-1]
            return role or ACTOR_KINDS.get(class_name, class_name.lower())
    return None


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


# The modules whose import an import profile follows, in every process that makes it:
# the roles' libraries, torch's compiler, and what Ray's agents bring.
WATCHED = (
    "torch", "vllm", "transformers", "transformers.modeling_utils", "peft", "accelerate",
    "torch._dynamo", "torch._inductor", "torch.distributed.checkpoint", "triton",
    "ray", "grpc", "aiohttp", "opentelemetry", "rlhf_trainer",
)  # fmt: skip
PROFILE_VARIABLE = "STARTUP_IMPORTS_DIR"  # where each process writes its record
PROFILE_EVERY_S = 0.5
TOP_IMPORTS = 8


def record_imports() -> None:
    """In a process of a profiled run (a sitecustomize calls it as the interpreter
    starts): time every import this process makes, each thread's on its own CPU clock,
    and write what was found every PROFILE_EVERY_S to $STARTUP_IMPORTS_DIR/<pid>.json:
    the process's CPU-seconds, its imports' (the outermost ones', summed), the costliest
    outermost imports, and each WATCHED module imported, with its import's CPU-seconds
    and the imports in progress when it was made (what brought it in, outermost first)."""
    import importlib._bootstrap as bootstrap
    import threading

    folder = os.environ.get(PROFILE_VARIABLE)
    if not folder:
        return
    local = threading.local()
    outermost: dict[str, float] = {}
    watched: dict[str, dict[str, Any]] = {}
    find_and_load = bootstrap._find_and_load  # type: ignore[attr-defined]

    def timed(name: str, import_: Any) -> Any:
        stack: list[str] = local.__dict__.setdefault("stack", [])
        stack.append(name)
        loads = name not in sys.modules  # not a look-up of one loaded, or being loaded
        started = time.thread_time()
        try:
            return find_and_load(name, import_)
        finally:
            cpu_s = time.thread_time() - started
            stack.pop()
            if not stack:
                outermost[name] = outermost.get(name, 0.0) + cpu_s
            if loads and name in WATCHED and name not in watched:
                watched[name] = {"cpu_s": cpu_s, "by": list(stack)}

    def write() -> None:
        path = Path(folder) / f"{os.getpid()}.json"
        while True:
            imports = dict(outermost)  # a copy: other threads go on importing
            top = sorted(imports.items(), key=lambda item: -item[1])[:TOP_IMPORTS]
            record = {
                "argv": sys.argv[:4],
                "cpu_s": time.process_time(),
                "imports_cpu_s": sum(imports.values()),
                "top": dict(top),
                "watched": dict(watched),
            }
            path.with_suffix(".tmp").write_text(json.dumps(record))
            path.with_suffix(".tmp").replace(path)
            time.sleep(PROFILE_EVERY_S)

    bootstrap._find_and_load = timed  # type: ignore[attr-defined]
    threading.Thread(target=write, name="startup-imports", daemon=True).start()


def parent_of(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).ppid())
    except psutil.NoSuchProcess:
        return None


def profile_imports(checkout: Path = REPO) -> dict[str, Any]:
    """One run of the example in `checkout` to its first step, each of its Python
    processes recording its imports (`record_imports`, started by a sitecustomize on
    the run's PYTHONPATH): per live process at the first step, its kind and record."""
    with tempfile.TemporaryDirectory(prefix="startup-imports-") as folder:
        hook = Path(folder) / "sitecustomize.py"
        hook.write_text("from bench.overhead.startup import record_imports\nrecord_imports()\n")

        def records(run: psutil.Popen) -> list[dict[str, Any]]:
            # The processes now, their records once each has written one since: a run of
            # one step goes on to its end meanwhile (a process that ends keeps its last).
            kinds = {process.pid: kind for process, kind in run_processes(run).items()}
            time.sleep(2 * PROFILE_EVERY_S)
            found = [{"kind": kind, "pid": pid} for pid, kind in kinds.items()]
            for path in Path(folder).glob("*.json"):  # those not found in the run's tree too
                pid = int(path.stem)
                if pid not in kinds:
                    found.append({"kind": "outside", "pid": pid, "ppid": parent_of(pid)})
            for entry in found:
                path = Path(folder) / f"{entry['pid']}.json"
                entry |= json.loads(path.read_text()) if path.exists() else {}
            return sorted(found, key=lambda record: record["kind"])

        environment = {PROFILE_VARIABLE: folder}
        _, found, _, _ = run_example(checkout, environment, records, [Path(folder), REPO])
    return {"bench": "startup-imports", "example": str(EXAMPLE), "processes": found}


if __name__ == "__main__" and sys.argv[1:2] == ["imports"]:
    # python -m bench.overhead.startup imports [CHECKOUT]
    print(json.dumps(profile_imports(Path(sys.argv[2]) if len(sys.argv) > 2 else REPO)))
elif __name__ == "__main__":
    # python -m bench.overhead.startup [REPEATS [BEFORE_CHECKOUT [AFTER_CHECKOUT]]]
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    before = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    checkout = Path(sys.argv[3]) if len(sys.argv) > 3 else REPO
    print(json.dumps(measure_startup(repeats, before, checkout)))
