"""The reconciler driven by the test itself against the real control plane (API server,
garbage collector, KubeRay, kwok nodes): what one pass does, with the cache in a state
the test sets. A module of its own, as no operator process may act on these jobs: the
operator fixture lives and dies with the module that asks for it (test_operator)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import yaml

from rlhf_operator.api.validation import parse_spec
from rlhf_operator.controller.cache import CachedKube, ObjectCache
from rlhf_operator.controller.events import EventRecorder
from rlhf_operator.controller.kube import Kube
from rlhf_operator.controller.reconcile import Reconciler
from rlhf_operator.controller.restarts import LATE_VERDICT
from rlhf_operator.render.children import JOB_LABEL, JobRef, render_children
from rlhf_operator.render.meta import COMPONENT_LABEL

from .harness import ControlPlane
from .jobs import (
    CLUSTER_EXAMPLES,
    apply_example,
    apply_with_checkpoints,
    get,
    job_status,
    load,
)
from .util import get_json, rlhfjob


def test_the_same_event_again_is_counted_on_the_one_already_posted(
    controlplane: ControlPlane, namespace: str
) -> None:
    cp = controlplane
    recorder = EventRecorder(Kube(cp.api_client()), now=lambda: datetime.now(UTC))
    job = {"metadata": {"name": "counted", "namespace": namespace, "uid": "0a1b2c3d"}}
    stuck, placed = "pool value: 0/16 GPUs, Unschedulable", "pool value: 16/16 GPUs"

    def posted() -> list[tuple[str, str, int]]:
        found = get_json(cp, "events", "-n", namespace, "--field-selector",
                         "involvedObject.name=counted")["items"]  # fmt: skip
        return sorted((e["type"], e["message"], e["count"]) for e in found)

    for _ in range(3):
        recorder.post(job, "Unschedulable", stuck, warning=True)
    recorder.post(job, "Unschedulable", placed, warning=True)
    recorder.post(job, "Unschedulable", stuck, warning=False)  # another type: another Event
    assert posted() == sorted([("Warning", stuck, 3), ("Warning", placed, 1), ("Normal", stuck, 1)])
    # Gone (Events expire after an hour): the next one is posted afresh.
    cp.kubectl("delete", "events", "-n", namespace, "--all")
    recorder.post(job, "Unschedulable", stuck, warning=True)
    assert posted() == [("Warning", stuck, 1)]


@pytest.mark.parametrize(
    "rayjob_cached", [False, True], ids=["rayjob-collected", "configmap-collected"]
)
def test_a_job_deleted_before_the_cache_heard_of_it_gets_no_children(
    controlplane: ControlPlane, namespace: str, rayjob_cached: bool
) -> None:
    """The garbage collector takes a deleted job's children before the watch may have told
    the cache that the job went (CI runs saw its RayJob, and its ConfigMaps, made again,
    then collected). Whether the RayJob went first or a ConfigMap did (the RayJob's own
    DELETED still on the way), the reconcile asks the API server before it creates."""
    cp = controlplane
    job = yaml.safe_load(CLUSTER_EXAMPLES[0].read_text())
    job["metadata"] |= {"name": "gone", "namespace": namespace, "uid": "5e1d2c3b",
                        "resourceVersion": "1"}  # fmt: skip
    # A job reconciled before (it had children to collect). One whose status was never
    # written is new, and its reconcile asks nothing before its creates.
    job["status"] = {"phase": "Pending", "rayJob": "gone"}
    cache = ObjectCache(frozenset({"RLHFJob", "RayJob"}))
    cache.observe("RLHFJob", "ADDED", job)  # its DELETED event is still on the way
    if rayjob_cached:
        ref = JobRef("gone", namespace, job["metadata"]["uid"])
        *_, rayjob = render_children(ref, parse_spec(job["spec"]))
        rayjob["metadata"]["resourceVersion"] = "2"
        cache.observe("RayJob", "ADDED", rayjob)
    reconciler = Reconciler(CachedKube(cp.api_client(), cache))
    assert reconciler.reconcile(namespace, "gone").status is None
    # What the API server said stands until the watch says it: no reconcile asks again.
    assert cache.get("RLHFJob", namespace, "gone") is None
    children = get_json(cp, "configmaps,serviceaccounts,roles,rolebindings,rayjobs", "-n",
                        namespace, "-l", f"{JOB_LABEL}=gone")["items"]  # fmt: skip
    assert children == []


def test_a_new_jobs_report_comes_in_the_pass_after_its_children(
    controlplane: ControlPlane, namespace: str
) -> None:
    """A new job's first pass makes its children but its RoleBinding, and writes no status
    and no Event: in a burst, the queue (workqueue.py) gives the other new jobs' first
    passes priority over this report. The next pass makes the RoleBinding and writes them."""
    cp = controlplane
    apply_example(cp, namespace, CLUSTER_EXAMPLES[0].name)
    name = load(CLUSTER_EXAMPLES[0])["metadata"]["name"]
    cache = ObjectCache(frozenset({"RLHFJob", "RayJob"}))
    cache.observe("RLHFJob", "ADDED", rlhfjob(cp, name, namespace) or {})
    reconciler = Reconciler(CachedKube(cp.api_client(), cache))

    def events() -> list[str]:
        found = get_json(cp, "events", "-n", namespace, "--field-selector",
                         f"involvedObject.kind=RLHFJob,involvedObject.name={name}")["items"]  # fmt: skip
        return [e["reason"] for e in found]

    first = reconciler.reconcile(namespace, name)
    assert first.report_later and first.status is not None
    assert get(cp, "rayjob", name, namespace) is not None
    assert job_status(cp, name, namespace) == {} and events() == []
    assert get(cp, "rolebinding", f"{name}-reporter", namespace) is None
    second = reconciler.reconcile(namespace, name)
    assert not second.report_later
    status = job_status(cp, name, namespace)
    # One Event for its phase. KubeRay may have made pods already, and the scheduler
    # turned one away: that is reported beside it (Unschedulable).
    assert status["rayJob"] == name and events().count(status["phase"]) == 1, events()
    assert get(cp, "rolebinding", f"{name}-reporter", namespace) is not None


def test_a_new_job_collected_between_its_passes_gets_no_children_again(
    controlplane: ControlPlane, namespace: str
) -> None:
    """Between a new job's first pass and its report, the job may be deleted and its
    children collected before the cache hears that the job went: the second pass is not
    a new job's (which trusts a cache miss), so it asks before it makes anything."""
    cp = controlplane
    job = yaml.safe_load(CLUSTER_EXAMPLES[0].read_text())
    # Never on the API server: the job as the cache last saw it.
    job["metadata"] |= {"name": "gone", "namespace": namespace, "uid": "6f2e3d4c",
                        "resourceVersion": "1"}  # fmt: skip
    cache = ObjectCache(frozenset({"RLHFJob", "RayJob"}))
    cache.observe("RLHFJob", "ADDED", job)  # its DELETED event is still on the way
    reconciler = Reconciler(CachedKube(cp.api_client(), cache))
    assert reconciler.reconcile(namespace, "gone").report_later
    # From the cache, which holds what the pass made: the collector may have taken the
    # RayJob off the API server already, its owner never having been there.
    rayjob = cache.get("RayJob", namespace, "gone")
    assert rayjob is not None and rayjob["metadata"]["ownerReferences"][0]["uid"] == "6f2e3d4c"
    # As the collector does (or has done).
    cp.kubectl("delete", "rayjob", "gone", "-n", namespace, "--ignore-not-found")
    cache.observe("RayJob", "DELETED", rayjob)
    assert reconciler.reconcile(namespace, "gone").status is None
    assert cache.get("RayJob", namespace, "gone") is None  # it would hold one it made


@contextlib.contextmanager
def ray_head(said: str | None) -> Iterator[str]:
    """A Ray head's job API on loopback that says the job's status is `said` (None: an
    address where nothing listens); yields its host:port, as KubeRay's dashboardURL."""

    class JobAPI(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"status": said, "message": f"the job is {said}"}).encode()
            self.send_response(200 if self.path == f"/api/jobs/{RAY_JOB_ID}" else 404)
            self.end_headers()
            self.wfile.write(body)

    server = http.server.HTTPServer(("127.0.0.1", 0), JobAPI)
    port = server.server_address[1]
    if said is None:
        server.server_close()  # the port is free: nothing answers there
        yield f"127.0.0.1:{port}"
        return
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


RAY_JOB_ID = "colocated-x7k2p"


def submitter_pods(cp: ControlPlane, namespace: str, name: str) -> None:
    """The attempt's submitter as KubeRay's Job leaves it when the head was lost once:
    its first pod failed, the retry (`ray job logs --follow`) exited 0."""
    labels = {JOB_LABEL: name, COMPONENT_LABEL: "submitter"}
    for pod_name, phase in (
        (f"{name}-submitter-1", "Failed"),
        (f"{name}-submitter-2", "Succeeded"),
    ):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "labels": labels},
               # No scheduler takes it: only its status matters, written as its kubelet would.
               "spec": {"schedulerName": "nobody", "restartPolicy": "Never",
                        "containers": [{"name": "ray-job-submitter", "image": "unused"}]}}  # fmt: skip
        cp.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(pod))
        cp.kubectl("patch", "pod", pod_name, "-n", namespace, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": {"phase": phase}}))  # fmt: skip


@pytest.mark.parametrize(
    ("said", "reason"),
    [("SUCCEEDED", None), ("FAILED", "AppFailed"), (None, LATE_VERDICT)],
    ids=["the job succeeded", "the job failed", "no head to ask"],
)
def test_kuberays_late_failure_is_decided_by_what_the_head_says_of_the_ray_job(
    controlplane: ControlPlane, namespace: str, said: str | None, reason: str | None
) -> None:
    """KubeRay marks a RayJob Failed (LATE_VERDICT) when it reconciles it over 30 s after
    its submitter ended, without asking the head: here, as KubeRay would write it, after
    a retried submitter whose last pod exited 0 (which says nothing of the Ray job). The
    operator asks the head (its job API, where KubeRay's status points): a job that
    succeeded is Succeeded, with no restart and the same attempt; one that failed, or
    with no head to ask, is a failed attempt. A reconciler that reads live (no watch)."""
    cp, name = controlplane, "colocated"
    apply_with_checkpoints(cp, namespace, "colocated.yaml")
    reconciler = Reconciler(Kube(cp.api_client()))
    assert reconciler.reconcile(namespace, name).report_later  # its RayJob; then its report
    assert not reconciler.reconcile(namespace, name).report_later
    attempt = get(cp, "rayjob", name, namespace)
    assert attempt is not None
    submitter_pods(cp, namespace, name)
    with ray_head(said) as head:
        late = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": LATE_VERDICT,
                "message": "The RayJob submitter finished at 2026-11-30 21:20:40 but the ray "
                "job did not reach terminal state within 30s", "dashboardURL": head,
                "jobId": RAY_JOB_ID}  # fmt: skip
        cp.kubectl("patch", "rayjob", name, "-n", namespace, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": late}))  # fmt: skip
        reconciled = reconciler.reconcile(namespace, name).status
    status = job_status(cp, name, namespace)
    assert reconciled is not None and reconciled.to_dict()["phase"] == status["phase"]
    if reason is None:
        assert (status["phase"], status.get("restarts", 0)) == ("Succeeded", 0), status
        assert "lastFailure" not in status, status
    else:
        assert status["phase"] in ("Restarting", "Failed"), status
        failure = status["lastFailure"]
        assert (failure["reason"], failure["rayJobUID"]) == (reason, attempt["metadata"]["uid"])
    assert get(cp, "rayjob", name, namespace)["metadata"]["uid"] == attempt["metadata"]["uid"]  # type: ignore[index]
