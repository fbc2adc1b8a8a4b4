"""A job's NetworkPolicy, as the operator renders it with the chart's default values,
enforced on the real node (network_policies.py): the head admits the job's own pods on
every port, Prometheus on the metrics ports and KubeRay on the dashboard port, and
refuses everything else, the job's own environments too (they run the model's tool
calls).

A head stand-in serves the head's three ports; one client pod stands for each kind of
peer. Each client dials each port from inside its pod (kubectl exec). The same dials
before the policy exists, with the enforcer already running, all connect: what is
refused afterwards is refused by the policy."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml

from rlhf_operator.render.children import TRAINER_METRICS_PORT
from rlhf_operator.render.meta import JOB_POD_COMPONENTS, JobRef, labels, metadata, pods_of
from rlhf_operator.render.network import (
    RAY_DASHBOARD_PORT,
    RAY_METRICS_PORT,
    NetworkAccess,
    render_network_policy,
)

from .harness import ControlPlane
from .network_policies import enforcer_log, network_policies_enforced
from .node import NETTOOL_IMAGE, RealNode
from .scan_manifests import chart_network_access
from .test_node import nettool_pod, wait_ready
from .util import eventually

pytestmark = pytest.mark.slow  # the enforcer, seven pods and a few dozen dials: ~1 min

HEAD_PORTS = (RAY_DASHBOARD_PORT, RAY_METRICS_PORT, TRAINER_METRICS_PORT)
IDLE_PORT = 9999  # what the clients serve, only to keep running


def clients(job: JobRef) -> dict[str, dict[str, str]]:
    """Each client pod's name and labels."""
    return {
        "worker": labels(job, "worker"),
        "submitter": labels(job, "submitter"),
        "environment": labels(job, "environment"),  # the job's, but not a Ray pod
        "prometheus": {"app.kubernetes.io/name": "prometheus"},
        "kuberay-helm": {"app.kubernetes.io/name": "kuberay-operator"},  # KubeRay's Helm chart's
        "kuberay": {"app.kubernetes.io/name": "kuberay"},  # KubeRay's kustomize manifests'
        "outsider": {"app": "outsider"},
    }


def head_pod(job: JobRef) -> dict[str, Any]:
    pod = nettool_pod("head", [])
    pod["metadata"]["labels"] = labels(job, "head")
    probe = {"periodSeconds": 1}  # the kubelet's probes come from the node: never queued
    pod["spec"]["containers"] = [
        {"name": f"port-{port}", "image": NETTOOL_IMAGE, "imagePullPolicy": "Never",
         "args": ["serve", str(port)], "readinessProbe": {"tcpSocket": {"port": port}, **probe}}
        for port in HEAD_PORTS
    ]  # fmt: skip
    return pod


def client_pod(name: str, pod_labels: dict[str, str]) -> dict[str, Any]:
    pod = nettool_pod(name, ["serve", str(IDLE_PORT)])
    pod["metadata"]["labels"] = pod_labels
    return pod


def reaches(cp: ControlPlane, namespace: str, client: str, ip: str) -> dict[int, bool]:
    """Which of the head's ports `client` connects to (nettool's dial: 3 s, then a
    timeout: the enforcer drops a refused connection's first packet)."""
    checks = [f"dial={ip}:{port}" for port in HEAD_PORTS]
    out = cp.kubectl("exec", "-n", namespace, client, "--", "/nettool", "check", *checks).stdout
    found = {r["check"]: r["ok"] for r in map(json.loads, out.splitlines())}
    return {port: found[f"dial={ip}:{port}"] for port in HEAD_PORTS}


def reachability(cp: ControlPlane, namespace: str, names: list[str], ip: str) -> dict[str, Any]:
    with ThreadPoolExecutor(len(names)) as pool:
        found = pool.map(lambda name: reaches(cp, namespace, name, ip), names)
        return dict(zip(names, found, strict=True))


def test_a_jobs_policy_admits_its_pods_prometheus_and_kuberay_and_refuses_the_rest(
    controlplane: ControlPlane, real_node: RealNode
) -> None:
    cp = controlplane
    real_node.import_go_image("nettool", NETTOOL_IMAGE)
    namespace = f"t-netpol-{uuid.uuid4().hex[:6]}"
    cp.create_namespace(namespace)
    job = JobRef(name="netpol", namespace=namespace, uid=str(uuid.uuid4()))
    peers = clients(job)
    pods = [head_pod(job), *(client_pod(name, peer) for name, peer in peers.items())]
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(pods))
    try:
        head_ip = wait_ready(cp, namespace, "head")["status"]["podIP"]
        for name in peers:
            wait_ready(cp, namespace, name)
        with network_policies_enforced(cp) as enforcer:
            before = reachability(cp, namespace, list(peers), head_ip)
            meta = metadata(job, job.name, "network")
            meta.pop("ownerReferences")  # there is no RLHFJob here to own it
            access = NetworkAccess(**chart_network_access())
            job_pods = pods_of(job, JOB_POD_COMPONENTS)
            policy = render_network_policy(meta, job_pods, access, TRAINER_METRICS_PORT)
            cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(policy))
            # The enforcer writes its rules as the policy arrives: until the outsider is
            # refused at one port, the others' results would be the old rules'.
            eventually(
                lambda: not reaches(cp, namespace, "outsider", head_ip)[RAY_DASHBOARD_PORT],
                "the outsider refused once the policy is in place",
            )
            after = reachability(cp, namespace, list(peers), head_ip)
            log = enforcer_log(cp, enforcer)
    finally:
        cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)

    assert enforcer["spec"]["nodeName"] == real_node.name
    # The refusals are its verdicts, not a network fault.
    assert 'verdict="drop"' in log and 'verdict="accept"' in log, log[-3000:]
    everything = dict.fromkeys(HEAD_PORTS, True)
    assert before == dict.fromkeys(peers, everything), before
    nothing = dict.fromkeys(HEAD_PORTS, False)
    metrics = {RAY_DASHBOARD_PORT: False, RAY_METRICS_PORT: True, TRAINER_METRICS_PORT: True}
    dashboard = {RAY_DASHBOARD_PORT: True, RAY_METRICS_PORT: False, TRAINER_METRICS_PORT: False}
    assert after == {
        "worker": everything,
        "submitter": everything,
        "environment": nothing,
        "prometheus": metrics,
        "kuberay-helm": dashboard,
        "kuberay": dashboard,
        "outsider": nothing,
    }, after
