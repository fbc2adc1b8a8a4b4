"""A lane of its own for the control-plane tier, when pytest-xdist runs three workers.

The control-plane tier is one xdist group (its tests share one cluster), so one worker
runs it from start to end. Its tests wait on the API server, the kubelet and the
operators for a fifth of their time or more. With two workers, the other one trains
alone beside it, and the two cores stay a fifth idle (measured: 80% busy). With three,
the tier keeps its worker and two trainer groups run side by side on the others: never
three trainer runs at once (memory: each holds several GiB), and the cores stay busy.

`make test` runs `-n 3 --dist loadgroup`. With fewer workers, another --dist mode, or no
control-plane tests in the run, xdist schedules as it always does.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadGroupScheduling

LANE_GROUP = "controlplane"  # the xdist group of tests/controlplane (tests/conftest.py)
LANE_MIN_WORKERS = 3  # the lane's worker, and two for everything else


class ControlPlaneLane(LoadGroupScheduling):
    """xdist's loadgroup, except that the first worker to ask takes the lane's group,
    first and alone, and ends once it has run it; the others never take that group."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.lane_worker: Any = None

    def _assign_work_unit(self, node: Any) -> None:
        if node is self.lane_worker:
            node.shutdown()  # every test of its group is sent: it ends after them
            return
        if (
            self.lane_worker is None
            and self.numnodes >= LANE_MIN_WORKERS
            and LANE_GROUP in self.workqueue
        ):
            self.lane_worker = node
            self.workqueue.move_to_end(LANE_GROUP, last=False)  # the unit taken next
        super()._assign_work_unit(node)
