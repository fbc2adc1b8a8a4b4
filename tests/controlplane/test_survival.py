"""What a job survives (docs/operations/survival.md) when the operator or the API server
fails: the active replica stopped or killed (the standby takes over; a failed attempt is
counted once and the next one started once), and the API server unreachable (the reconcile retries with
a growing delay, counts its errors, and catches up when the API server is back).

KubeRay's part, reporting an attempt's failure, is played by patching the RayJob's
status as KubeRay would (as test_operator.py does)."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from .harness import REPO_ROOT, ControlPlane
from .jobs import apply, apply_example, get, job_status, load, status_when
from .operator_process import OperatorProcess
from .util import eventually, get_json

JOB = "colocated"
RECONCILES = "rlhf_operator_reconcile_duration_seconds_count"
ERRORS = "rlhf_operator_reconcile_errors_total"
LIFETIME = 10  # the replicas' --lease-duration: how long a dead active one blocks the standby
CHILD_KINDS = ("configmaps", "serviceaccounts", "roles", "rolebindings")


def job_with_restarts(backoff: int) -> dict[str, Any]:
    manifest = load(REPO_ROOT / "examples" / f"{JOB}.yaml")
    manifest["spec"] |= {
        "checkpointClaim": "checkpoints",
        "restartPolicy": {"maxRestarts": 1, "backoffSeconds": backoff},
    }
    return manifest


def rayjob_uid(cp: ControlPlane, namespace: str) -> str | None:
    return ((get(cp, "rayjob", JOB, namespace) or {}).get("metadata") or {}).get("uid")


def another_attempt(cp: ControlPlane, namespace: str, than: str) -> str | None:
    uid = rayjob_uid(cp, namespace)
    return uid if uid and uid != than else None


def fail_attempt(cp: ControlPlane, namespace: str) -> None:
    failure = {"jobDeploymentStatus": "Failed", "reason": "AppFailed",
               "message": "trainer exited with 1"}  # fmt: skip
    cp.kubectl("patch", "rayjob", JOB, "-n", namespace, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": failure}))  # fmt: skip


def lease_holder(cp: ControlPlane, lease: str) -> str:
    found = cp.kubectl("get", "lease", lease, "-n", "default", "-o",
                       "jsonpath={.spec.holderIdentity}", check=False)  # fmt: skip
    return found.stdout.strip()


def caught_up(cp: ControlPlane, namespace: str) -> dict[str, Any]:
    """The job's status once it names the RayCluster KubeRay made for the current
    RayJob: the operator has seen the RayJob's latest change."""

    def cluster() -> str | None:
        rayjob = get(cp, "rayjob", JOB, namespace) or {}
        return (rayjob.get("status") or {}).get("rayClusterName")

    name = eventually(cluster, "KubeRay's RayCluster for the current attempt")
    return eventually(lambda: status_when(cp, JOB, namespace, rayCluster=name), "the status")


def child_uids(cp: ControlPlane, kind: str, namespace: str) -> list[str]:
    items = get_json(cp, kind, "-n", namespace, "-l", f"rlhf.dev/job={JOB}")["items"]
    return sorted(item["metadata"]["uid"] for item in items)


def restarting_events(cp: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    """The job's Events of its turning Restarting."""
    selector = ("--field-selector", "reason=Restarting")
    items: list[dict[str, Any]] = get_json(cp, "events", "-n", namespace, *selector)["items"]
    return items


def failed_reconciles(log: str, namespace: str = r"\S+") -> list[tuple[datetime, int, int]]:
    """(when, attempt, delay in seconds) of each failed reconcile the operator logged."""
    line = re.compile(rf"^(\S+ \S+) ERROR rlhf_operator: reconcile of {namespace}/\S+ failed "
                      r"\(attempt (\d+)\); retry in (\d+)s$", re.MULTILINE)  # fmt: skip
    return [
        (datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f"), int(attempt), int(delay))
        for when, attempt, delay in line.findall(log)
    ]


@contextlib.contextmanager
def two_replicas(
    cp: ControlPlane, operator: OperatorProcess
) -> Iterator[tuple[OperatorProcess, OperatorProcess]]:
    """An active replica and a standby electing through a Lease of their own (as the
    chart runs them), in place of the module's standalone operator, which comes back
    after."""
    operator.stop()
    lease = f"rlhf-operator-{uuid.uuid4().hex[:6]}"  # fresh: no holder left by a killed one
    args = ("--lease", lease, "--lease-namespace", "default", "--lease-duration", str(LIFETIME),
            "-A")  # fmt: skip
    active = OperatorProcess(cp, "operator-active", *args, env={"POD_NAME": "operator-active"})
    standby = OperatorProcess(cp, "operator-standby", *args, env={"POD_NAME": "operator-standby"})
    try:
        active.start()
        eventually(lambda: lease_holder(cp, lease) == "operator-active", "the Lease taken")
        standby.start()  # ready, waiting to lead
        yield active, standby
    finally:
        active.stop()
        standby.stop()
        operator.start()


def test_two_replicas_with_a_lease_one_active_then_failover(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp = controlplane
    with two_replicas(cp, operator) as (active, standby):
        apply_example(cp, namespace, f"{JOB}.yaml")
        eventually(lambda: active.metric(RECONCILES) > 0, "the active replica to reconcile")
        eventually(lambda: job_status(cp, JOB, namespace).get("rayJob"), "its status")
        assert standby.metric(RECONCILES) == 0

        active.stop()  # a clean exit gives the Lease up at once
        apply_example(cp, namespace, "asymmetric-6-2.yaml")
        eventually(
            lambda: job_status(cp, "asymmetric-6-2", namespace).get("rayJob"),
            "the standby to take over",
        )
        assert standby.metric(RECONCILES) > 0


def test_a_killed_active_replica_is_replaced_and_its_failed_attempt_counted_once(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """The active replica counts an attempt's failure and is SIGKILLed during the
    backoff: the standby takes over once the dead replica's Lease expires (LIFETIME),
    counts nothing again, and starts the next attempt once; no other child is made anew."""
    cp = controlplane
    with two_replicas(cp, operator) as (active, standby):
        apply(cp, namespace, job_with_restarts(backoff=8))  # longer than the kill takes
        first = eventually(lambda: rayjob_uid(cp, namespace), "the first attempt")
        children = {kind: child_uids(cp, kind, namespace) for kind in CHILD_KINDS}
        fail_attempt(cp, namespace)
        eventually(lambda: status_when(cp, JOB, namespace, phase="Restarting", restarts=1),
                   "the active replica to count the failure")  # fmt: skip
        # It posts the phase's Event just after the status (a replica killed between the
        # two loses it: Events are best effort); what is checked is that none comes twice.
        eventually(lambda: restarting_events(cp, namespace), "its Restarting event")
        active.kill()
        killed = time.monotonic()
        assert rayjob_uid(cp, namespace) == first, "the backoff ended before the kill"

        eventually(lambda: standby.metric(RECONCILES) > 0, "the standby to take over")
        print(f"the standby took over {time.monotonic() - killed:.1f}s after the kill")
        second = eventually(lambda: another_attempt(cp, namespace, first), "the next attempt")
        status = caught_up(cp, namespace)  # the standby reconciled since: a copy would show
        assert status["restarts"] == 1 and status["lastFailure"]["rayJobUID"] == first
        rayjobs = get_json(cp, "rayjobs", "-n", namespace)["items"]
        assert [rayjob["metadata"]["uid"] for rayjob in rayjobs] == [second]
        assert {kind: child_uids(cp, kind, namespace) for kind in CHILD_KINDS} == children
        eventually(lambda: len(get_json(cp, "rayclusters", "-n", namespace)["items"]) == 1,
                   "the failed attempt's RayCluster to go")  # fmt: skip
        events = restarting_events(cp, namespace)
        assert len(events) == 1, [e["message"] for e in events]


def test_the_reconcile_retries_with_a_growing_delay_while_the_api_server_is_down(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """An attempt fails and is counted; the API server stops before its backoff ends.
    The reconcile at the end of the backoff fails, and is retried after 1, 2, 5 s...
    (RETRY_SECONDS; each failure's log line names the delay) until the API server is back
    (after the third failure); then the next attempt starts."""
    cp = controlplane
    apply(cp, namespace, job_with_restarts(backoff=5))  # longer than the stop takes
    first = eventually(lambda: rayjob_uid(cp, namespace), "the first attempt")
    fail_attempt(cp, namespace)
    eventually(lambda: status_when(cp, JOB, namespace, phase="Restarting", restarts=1),
               "the failure to be counted")  # fmt: skip
    errors, seen = operator.metric(ERRORS), len(operator.log())

    def mine() -> list[tuple[datetime, int, int]]:
        return failed_reconciles(operator.log()[seen:], namespace)

    stopped = time.monotonic()
    with cp.api_server_stopped():
        while_down = eventually(lambda: len(mine()) >= 3 and mine(), "three failed reconciles")
    print(f"the API server was down (and its clients back) {time.monotonic() - stopped:.1f}s")

    second = eventually(lambda: another_attempt(cp, namespace, first), "the next attempt")
    status = caught_up(cp, namespace)
    assert status["restarts"] == 1 and status["lastFailure"]["rayJobUID"] == first
    assert rayjob_uid(cp, namespace) == second
    failures = mine()
    print(f"failed reconciles (when, attempt, delay): {failures}")
    assert [attempt for _, attempt, _ in failures] == list(range(1, len(failures) + 1))
    delays = [delay for _, _, delay in failures]
    assert delays[:3] == [1, 2, 5] and delays == sorted(delays) and delays[-1] <= 60
    # Not sooner than it said. The first retry is left out: an event that came in while the
    # first failing reconcile ran (a child's, sent just before the stop) queues the job again
    # at once, as controller-runtime does; once the API server is down, no event can.
    for (when, _, delay), (then, _, _) in itertools.pairwise(while_down[1:]):
        assert (then - when).total_seconds() >= delay - 0.01
    # Every failed reconcile (any job's) is counted once.
    assert operator.metric(ERRORS) - errors == len(failed_reconciles(operator.log()[seen:]))
