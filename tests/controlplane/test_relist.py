"""The operator's cache stays true through a watch's gap (controller/relist.py): a child
deleted while the operator could not watch is made again once kopf lists anew.

The gap is made as it happens in a cluster: the operator stops (SIGSTOP), the API server
restarts (the operator's watch connections end), and a child is deleted before the
operator goes on. Its watches then resume from a resourceVersion older than the new API
server's watch cache, which answers 410 Gone; kopf lists again and sends what exists,
never a DELETED for what went. Without the re-list the cache would keep the deleted
ConfigMap and the job would never have it again. (Deleted before the restart, the event
would wait in the stopped operator's socket and arrive.)"""

from __future__ import annotations

import os
import signal

from .harness import ControlPlane
from .jobs import apply_example, get, recreated
from .operator_process import OperatorProcess
from .util import eventually

JOB = "colocated"
SPEC = f"{JOB}-spec"  # the job's ConfigMap


def test_a_child_deleted_in_the_watchs_gap_is_made_again_after_the_relist(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp = controlplane
    apply_example(cp, namespace, f"{JOB}.yaml")
    first = eventually(lambda: get(cp, "configmap", SPEC, namespace), f"ConfigMap {SPEC}")
    eventually(lambda: get(cp, "rayjob", JOB, namespace), f"RayJob {JOB}")
    assert operator.proc is not None
    seen = len(operator.log())
    os.kill(operator.proc.pid, signal.SIGSTOP)
    try:
        with cp.api_server_stopped():
            pass
        cp.kubectl("delete", "configmap", SPEC, "-n", namespace)
    finally:
        os.kill(operator.proc.pid, signal.SIGCONT)
    again = eventually(
        lambda: recreated(cp, "configmap", SPEC, namespace, first["metadata"]["uid"]),
        f"ConfigMap {SPEC} to be made again",
    )
    assert again["metadata"]["ownerReferences"][0]["name"] == JOB
    relisted = [
        line for line in operator.log()[seen:].splitlines() if "re-list of ConfigMap" in line
    ]
    assert any(namespace in line for line in relisted), operator.log()[seen:][-3000:]
    assert operator.metric("rlhf_operator_api_requests_total", verb="relist", kind="ConfigMap") > 0
