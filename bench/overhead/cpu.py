"""CPU-seconds of process trees: beside wall time, the figure that other work on a shared
machine changes least (a loaded machine stretches every hand-off between processes,
which the job has more of)."""

from __future__ import annotations

from collections.abc import Iterable

import psutil  # type: ignore[import-untyped]


def tree_cpu_seconds(root: int, skip: Iterable[int] = ()) -> float:
    """User and system CPU-seconds used so far by process `root` and its descendants,
    leaving out the trees rooted at `skip`."""
    top = psutil.Process(root)
    left_out: set[int] = set()
    for pid in skip:
        left_out |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    total = 0.0
    for process in [top, *top.children(recursive=True)]:
        if process.pid in left_out:
            continue
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total
