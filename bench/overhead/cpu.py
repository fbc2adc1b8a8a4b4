"""CPU-seconds of process trees: beside wall time, the figure that other work on a shared
machine changes least (a loaded machine stretches every hand-off between processes,
which the job has more of). `tree_cpu_by_part` splits the job's into its parts, to say
where the CPU over the bare engine's goes."""

from __future__ import annotations

from collections.abc import Iterable

import psutil  # type: ignore[import-untyped]

# A job's processes by what they are (`part_of`); "other": Ray's idle workers and agents.
PARTS = ("driver", "engine_core", "rollout_rank", "queue", "ranks", "ray_daemons", "other")


def tree_processes(root: int, skip: Iterable[int]) -> list[psutil.Process]:
    """`root` and its descendants, without the trees rooted at `skip`: one scan of the
    machine's processes (each `Process.children` call is a scan of its own)."""
    children: dict[int, list[psutil.Process]] = {}
    for process in psutil.process_iter(["ppid"]):
        children.setdefault(process.info["ppid"], []).append(process)
    left_out, found, todo = set(skip), [], [psutil.Process(root)]
    while todo:
        process = todo.pop()
        if process.pid not in left_out:
            found.append(process)
            todo += children.get(process.pid, [])
    return found


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(times.user + times.system)


def tree_cpu_seconds(root: int, skip: Iterable[int] = ()) -> float:
    """User and system CPU-seconds used so far by process `root` and its descendants,
    leaving out the trees rooted at `skip`."""
    return sum(_cpu(process) for process in tree_processes(root, skip))


def part_of(process: psutil.Process, root: int, rollout_ranks: set[int]) -> str:
    """Which of PARTS a process of the job's tree is; `rollout_ranks`: the rank hosts
    that are an engine core's parents (`engine_parents`)."""
    if process.pid == root:
        return "driver"
    try:
        name, command = process.name(), " ".join(process.cmdline()[:1])
    except psutil.NoSuchProcess:
        return "other"
    if "EngineCore" in name or "EngineCore" in command:
        return "engine_core"
    if "SampleQueue" in command:
        return "queue"
    if "RankHost" in command:
        return "rollout_rank" if process.pid in rollout_ranks else "ranks"
    if name in ("raylet", "gcs_server") or "dashboard.py" in command:
        return "ray_daemons"
    return "other"


def engine_parents(processes: Iterable[psutil.Process]) -> set[int]:
    """The parents of vLLM engine cores among `processes`: the rollout ranks. One read
    of each process (`Process.children` would scan every process of the machine)."""
    parents = set()
    for process in processes:
        try:
            if "EngineCore" in process.name():
                parents.add(process.ppid())
        except psutil.NoSuchProcess:
            continue
    return parents


def tree_cpu_by_part(root: int, skip: Iterable[int] = ()) -> dict[str, float]:
    """`tree_cpu_seconds` split by PARTS."""
    parts = dict.fromkeys(PARTS, 0.0)
    processes = tree_processes(root, skip)
    rollout_ranks = engine_parents(processes)
    for process in processes:
        parts[part_of(process, root, rollout_ranks)] += _cpu(process)
    return parts
