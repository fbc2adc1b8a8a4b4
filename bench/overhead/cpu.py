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
    """`root` and its descendants, without the trees rooted at `skip`."""
    top = psutil.Process(root)
    left_out: set[int] = set()
    for pid in skip:
        left_out |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    return [p for p in [top, *top.children(recursive=True)] if p.pid not in left_out]


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


def part_of(process: psutil.Process, root: int) -> str:
    """Which of PARTS a process of the job's tree is. A rank host whose child is a vLLM
    engine core is the rollout rank; the other rank hosts are the training roles'."""
    if process.pid == root:
        return "driver"
    try:
        name = process.name()
        command = " ".join(process.cmdline()[:1])
        children = [child.name() for child in process.children()]
    except psutil.NoSuchProcess:
        return "other"
    if "EngineCore" in name or "EngineCore" in command:
        return "engine_core"
    if "SampleQueue" in command:
        return "queue"
    if "RankHost" in command:
        return "rollout_rank" if any("EngineCore" in c for c in children) else "ranks"
    if name in ("raylet", "gcs_server") or "dashboard.py" in " ".join(process.cmdline()):
        return "ray_daemons"
    return "other"


def tree_cpu_by_part(root: int, skip: Iterable[int] = ()) -> dict[str, float]:
    """`tree_cpu_seconds` split by PARTS."""
    parts = dict.fromkeys(PARTS, 0.0)
    for process in tree_processes(root, skip):
        parts[part_of(process, root)] += _cpu(process)
    return parts
