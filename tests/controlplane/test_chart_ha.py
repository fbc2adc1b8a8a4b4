"""The chart at `replicas: 2` on the real control plane: the Deployment's two pods, each
played by an operator process with the pod's name (what the downward API gives it) and
the chart's token, elect one leader through the chart's Lease; the leader's pod deleted,
the other takes over, and no child is made twice."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .harness import ControlPlane
from .jobs import apply_example, job_status
from .operator_process import OperatorProcess
from .test_chart import CHART, chart_env, of_kind
from .test_examples import requests_made
from .util import eventually, get_json, provide_example_claims, remove_example_claims

LEASE_SECONDS = 6  # leaseDurationSeconds: short, so a failed hand-over shows quickly
RECONCILES = "rlhf_operator_reconcile_duration_seconds_count"
JOBS = ("colocated", "asymmetric-6-2")  # one per leader
CHILD_KINDS = ("configmaps", "serviceaccounts", "roles", "rolebindings", "rayjobs")


@dataclass(frozen=True)
class HARelease:
    name: str
    namespace: str  # the Deployment's, and the Lease's
    jobs: str  # the namespace it watches
    kubeconfig: Path  # the chart's ServiceAccount's token


@pytest.fixture
def ha_release(controlplane: ControlPlane, tmp_path: Path) -> Iterator[HARelease]:
    cp, suffix = controlplane, uuid.uuid4().hex[:6]
    name, namespace, jobs = f"ha-{suffix}", f"ha-system-{suffix}", f"ha-jobs-{suffix}"
    cp.create_namespace(jobs)
    provide_example_claims(cp, jobs)
    cp.helm("install", name, str(CHART), "--namespace", namespace, "--create-namespace",
            "--set", "replicas=2", "--set", f"leaseDurationSeconds={LEASE_SECONDS}",
            "--set-json", f'watchNamespaces=["{jobs}"]')  # fmt: skip
    token = cp.kubectl("create", "token", f"{name}-rlhf-operator", "-n", namespace).stdout
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "cp", "cluster": {"server": cp.server,
                                                "certificate-authority": str(cp.ca_file)}}],
        "users": [{"name": "sa", "user": {"token": token.strip()}}],
        "contexts": [{"name": "sa", "context": {"cluster": "cp", "user": "sa"}}],
    }))  # fmt: skip
    yield HARelease(name, namespace, jobs, kubeconfig)
    cp.helm("uninstall", name, "--namespace", namespace, check=False)
    cp.kubectl("delete", "namespace", jobs, namespace, "--wait=false")
    remove_example_claims(cp, jobs)
    cp.kubectl("delete", "pods", "--all", "-n", jobs, "--grace-period=0", "--force")


def operator_pods(cp: ControlPlane, release: HARelease) -> list[str]:
    selector = f"app.kubernetes.io/instance={release.name}"
    items = get_json(cp, "pods", "-n", release.namespace, "-l", selector)["items"]
    return sorted(p["metadata"]["name"] for p in items if "deletionTimestamp" not in p["metadata"])


def holder(cp: ControlPlane, release: HARelease) -> str:
    found = cp.kubectl("get", "lease", f"{release.name}-rlhf-operator", "-n", release.namespace,
                       "-o", "jsonpath={.spec.holderIdentity}", check=False)  # fmt: skip
    return found.stdout.strip()


def child_uids(cp: ControlPlane, namespace: str) -> dict[str, list[str]]:
    def uids(kind: str) -> list[str]:
        items = get_json(cp, kind, "-n", namespace, "-l", "rlhf.dev/job")["items"]
        return sorted(item["metadata"]["uid"] for item in items)

    return {kind: uids(kind) for kind in CHILD_KINDS}


def creates(operator: OperatorProcess) -> dict[str, int]:
    """The children it created, by kind (not its Events)."""
    kinds = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob")
    return {
        k: v
        for k, v in requests_made(operator).items()
        if k in {f"create {kind}" for kind in kinds}
    }


def test_two_replicas_from_the_chart_elect_one_leader_and_hand_over_when_its_pod_goes(
    controlplane: ControlPlane, ha_release: HARelease
) -> None:
    cp, release = controlplane, ha_release
    pods = eventually(lambda: found if len(found := operator_pods(cp, release)) == 2 else None,
                      "the Deployment's two pods")  # fmt: skip
    manifest = cp.helm("get", "manifest", release.name, "-n", release.namespace).stdout
    (deployment,) = of_kind([d for d in yaml.safe_load_all(manifest) if d], "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]

    def replica_for(pod: str) -> OperatorProcess:
        return OperatorProcess(cp, f"{release.name}-{pod}", *container["args"],
                               kubeconfig=release.kubeconfig, env=chart_env(container, pod))  # fmt: skip

    replicas = {pod: replica_for(pod) for pod in pods}
    try:
        for replica in replicas.values():
            replica.start()  # ready: a standby is ready to take over
        leader_pod = eventually(lambda: holder(cp, release) in replicas and holder(cp, release),
                                "one replica to hold the Lease")  # fmt: skip
        (standby_pod,) = set(pods) - {leader_pod}
        leader, standby = replicas[leader_pod], replicas[standby_pod]

        apply_example(cp, release.jobs, f"{JOBS[0]}.yaml")
        eventually(lambda: job_status(cp, JOBS[0], release.jobs).get("rayJob"), "the leader")
        assert leader.metric(RECONCILES) > 0 and standby.metric(RECONCILES) == 0
        assert "waiting to lead" in standby.log()
        children, made_by_leader = child_uids(cp, release.jobs), creates(leader)

        # The kubelet's part: the pod deleted, its container gets SIGTERM.
        cp.kubectl("delete", "pod", leader_pod, "-n", release.namespace, "--wait=false")
        assert leader.proc is not None
        os.killpg(leader.proc.pid, signal.SIGTERM)
        stopped = time.monotonic()
        eventually(lambda: holder(cp, release) == standby_pod, "the standby to take the Lease")
        took = time.monotonic() - stopped
        print(f"the standby took the Lease {took:.1f}s after the leader's SIGTERM")
        assert took < LEASE_SECONDS  # a clean stop gives the Lease up: no wait for it to expire
        leader.stop()

        apply_example(cp, release.jobs, f"{JOBS[1]}.yaml")
        eventually(lambda: job_status(cp, JOBS[1], release.jobs).get("rayJob"), "the new leader")
        assert standby.metric(RECONCILES) > 0
        now = child_uids(cp, release.jobs)
        # The first job's children are those the first leader made, each made once, and
        # the new leader made only the second job's.
        assert all(set(children[kind]) <= set(now[kind]) for kind in CHILD_KINDS), (children, now)
        assert all(len(now[kind]) == 2 * len(children[kind]) for kind in CHILD_KINDS), now
        assert made_by_leader == creates(standby), (made_by_leader, creates(standby))
        assert made_by_leader["create RayJob"] == 1

        # The pod the ReplicaSet made in place of the deleted one: a standby now, which a
        # SIGTERM stops at once (it leaves kopf's startup, holding nothing).
        (new_pod,) = eventually(
            lambda: [p for p in operator_pods(cp, release) if p not in pods] or None,
            "the deleted pod's replacement",
        )
        replicas[new_pod] = third = replica_for(new_pod).start()
        eventually(lambda: "waiting to lead" in third.log(), "the new pod to wait")
        assert holder(cp, release) == standby_pod and third.metric(RECONCILES) == 0
        stopping = time.monotonic()
        third.stop()
        assert third.proc is not None and third.proc.returncode != -signal.SIGKILL
        assert time.monotonic() - stopping < 10, third.log()[-2000:]
    finally:
        for replica in replicas.values():
            replica.stop()
