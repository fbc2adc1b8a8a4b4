"""Queued jobs under the real Kueue controller (built from its pinned Go module, like
KubeRay): a ClusterQueue whose GPU quota fits one job of two."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import needs

from .harness import REPO_ROOT, ControlPlane, can_run_kueue
from .jobs import apply, get, job_status, load
from .operator_process import OperatorProcess
from .util import eventually, get_json

pytestmark = needs(None if can_run_kueue() else "Kueue needs root and unshare")

QUEUE = "team"
JOB_GPUS = 8  # split-8gpu-4-4: two pools of 4 GPUs


@pytest.fixture(scope="module")
def kueue(controlplane: ControlPlane) -> ControlPlane:
    controlplane.start_kueue()
    return controlplane


@pytest.fixture
def queue(kueue: ControlPlane, namespace: str) -> Iterator[str]:
    """A LocalQueue in the namespace, under a ClusterQueue of JOB_GPUS GPUs."""
    name = f"gpus-{uuid.uuid4().hex[:6]}"
    quota = [{"name": "cpu", "nominalQuota": "1000"}, {"name": "memory", "nominalQuota": "10Ti"},
             {"name": "nvidia.com/gpu", "nominalQuota": JOB_GPUS}]  # fmt: skip
    objects = [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
         "metadata": {"name": name}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                  "resourceGroups": [{"coveredResources": [q["name"] for q in quota],
                                      "flavors": [{"name": name, "resources": quota}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": QUEUE, "namespace": namespace}, "spec": {"clusterQueue": name}},
    ]  # fmt: skip
    kueue.kubectl("create", "-f", "-", input="\n".join(json.dumps(o) for o in objects))
    for what in (["clusterqueue", name], ["localqueue", QUEUE, "-n", namespace]):
        eventually(lambda what=what: active(get_json(kueue, *what)), f"{what[0]} Active")
    yield QUEUE
    kueue.kubectl("delete", "clusterqueue,resourceflavor", name, "--wait=false", check=False)


def active(queue: dict[str, Any]) -> bool:
    conditions = (queue.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Active" and c["status"] == "True" for c in conditions)


def queued_job(name: str) -> dict[str, Any]:
    manifest = load(REPO_ROOT / "examples" / "split-8gpu-4-4.yaml")
    manifest["metadata"]["name"] = name
    manifest["spec"]["queueName"] = QUEUE
    return manifest


def ready_condition(cp: ControlPlane, name: str, namespace: str) -> dict[str, Any]:
    conditions = job_status(cp, name, namespace).get("conditions", [])
    return next((c for c in conditions if c["type"] == "Ready"), {})


def admitted(cp: ControlPlane, name: str, namespace: str) -> bool:
    """Kueue resumed the RayJob (its Go client drops a false `suspend`)."""
    rayjob = get(cp, "rayjob", name, namespace)
    return rayjob is not None and not rayjob["spec"].get("suspend", False)


def test_the_second_job_waits_queued_with_kueues_reason_until_the_first_finishes(
    kueue: ControlPlane, operator: OperatorProcess, namespace: str, queue: str
) -> None:
    cp = kueue
    apply(cp, namespace, queued_job("first"))
    eventually(lambda: admitted(cp, "first", namespace), "Kueue to admit the first job")
    apply(cp, namespace, queued_job("second"))

    def second_queued() -> dict[str, Any] | None:
        ready = ready_condition(cp, "second", namespace)
        return (
            ready
            if "insufficient unused quota for nvidia.com/gpu" in ready.get("message", "")
            else None
        )

    ready = eventually(second_queued, "the second job to be Queued with Kueue's reason")
    assert job_status(cp, "second", namespace)["phase"] == "Queued"
    assert ready["reason"] == "Queued"
    assert ready["message"].startswith(f"queued in LocalQueue {queue}: Pending: couldn't assign")
    assert job_status(cp, "first", namespace)["phase"] != "Queued"
    assert not admitted(cp, "second", namespace)
    events = get_json(cp, "events", "-n", namespace, "--field-selector",
                      "reason=Queued,involvedObject.name=second")["items"]  # fmt: skip
    assert events and "queued in LocalQueue" in events[0]["message"]

    # The first job ends, as KubeRay reports it: Kueue frees its quota for the second.
    done = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    cp.kubectl("patch", "rayjob", "first", "-n", namespace, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": done}))  # fmt: skip
    eventually(lambda: admitted(cp, "second", namespace), "Kueue to admit the second job")
    eventually(lambda: job_status(cp, "second", namespace).get("phase") not in (None, "Queued"),
               "the second job to leave Queued")  # fmt: skip
    eventually(lambda: job_status(cp, "first", namespace).get("phase") == "Succeeded",
               "the first job to be Succeeded")  # fmt: skip

    # Suspending a queued job deactivates its Workload, and Kueue suspends the RayJob.
    cp.kubectl("patch", "rlhfjob", "second", "-n", namespace, "--type=merge",
               "-p", json.dumps({"spec": {"suspend": True}}))  # fmt: skip
    eventually(lambda: not admitted(cp, "second", namespace), "Kueue to suspend the RayJob")
    workloads = get_json(cp, "workloads", "-n", namespace)["items"]
    second = [w for w in workloads if w["metadata"]["ownerReferences"][0]["name"] == "second"]
    assert [w["spec"].get("active") for w in second] == [False]
    eventually(lambda: job_status(cp, "second", namespace).get("phase") == "Suspended",
               "the second job to be Suspended")  # fmt: skip
