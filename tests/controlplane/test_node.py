"""The real node (node.py) runs pods for real: they log, reach the API server through the
`kubernetes` Service, reach each other through Services, resolve names with the cluster
DNS, and nothing they send to an address the cluster does not serve leaves the machine.

Nothing can be pulled here: the pods run nettool (go/node/nettool), imported into the
node's containerd. One server pod and one client pod serve every test of the module.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from .harness import SERVICE_CIDR, ControlPlane
from .node import (
    NETTOOL_IMAGE,
    NODE_IP,
    POD_SUBNET,
    REAL_NODE_LABELS,
    REAL_NODE_NAME,
    REAL_NODE_TAINT,
    RealNode,
    on_real_node,
)
from .util import eventually, get_json

PORT = 8080
COUNTER_COMMENT = "rlhf-test-node counter"


def nettool_pod(name: str, args: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": NETTOOL_IMAGE, "imagePullPolicy": "Never", "args": args}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": on_real_node({"containers": [container], **spec}),
    }


def web_objects() -> list[dict[str, Any]]:
    """An HTTP server whose readiness the kubelet probes at the pod's IP, and its Service."""
    probe = {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1}
    pod = nettool_pod("web", ["serve", str(PORT)], container={"readinessProbe": probe})
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": PORT}]},
    }
    return [pod, service]


def unused_service_ip(cp: ControlPlane) -> str:
    """An address of the Service range that no Service holds."""
    used = {s["spec"].get("clusterIP") for s in get_json(cp, "services", "-A")["items"]}
    hosts = list(ipaddress.ip_network(SERVICE_CIDR).hosts())
    return next(str(ip) for ip in reversed(hosts) if str(ip) not in used)


# --------------------------------------------------------------------------- packet counters


def _iptables(*args: str) -> str:
    return subprocess.run(
        ["iptables", "-t", "mangle", *args], check=True, capture_output=True, text=True
    ).stdout


def _packets(chain: str) -> int:
    listing = _iptables("-L", chain, "-v", "-x", "-n")
    return sum(int(line.split()[0]) for line in listing.splitlines() if COUNTER_COMMENT in line)


@contextmanager
def packet_counters(ip: str) -> Iterator[Callable[[], dict[str, int]]]:
    """Count packets to `ip` as the machine receives them (PREROUTING) and as it would
    send them anywhere (POSTROUTING): received but never sent means dropped here."""
    rule = ["-d", f"{ip}/32", "-m", "comment", "--comment", COUNTER_COMMENT]
    chains = ("PREROUTING", "POSTROUTING")
    for chain in chains:
        _iptables("-I", chain, "1", *rule)
    try:
        yield lambda: {chain: _packets(chain) for chain in chains}
    finally:
        for chain in chains:
            _iptables("-D", chain, *rule)


# --------------------------------------------------------------------------- the pods


@dataclass
class Probe:
    namespace: str
    web: dict[str, Any]  # the server pod
    web_ip: str  # its Service's ClusterIP
    web_logs: str
    client: dict[str, Any]  # the pod that ran the checks
    checks: dict[str, dict[str, Any]]  # check -> {"ok", "result", "error"}
    unused_ip: str
    packets: dict[str, int]  # to unused_ip, by chain


def _apply(cp: ControlPlane, namespace: str, objects: list[dict[str, Any]]) -> None:
    manifest = {"apiVersion": "v1", "kind": "List", "items": objects}
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def _pod(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = get_json(cp, "pod", name, "-n", namespace)
    return pod


def wait_ready(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    def ready() -> Any:  # the pod, once Ready
        pod = _pod(cp, namespace, name)
        conditions = pod.get("status", {}).get("conditions", [])
        return (
            pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None
        )

    return eventually(ready, f"pod {name} Ready")


def _run_client(cp: ControlPlane, namespace: str, checks: list[str]) -> dict[str, Any]:
    """Run nettool's checks in a pod; it exits 0 whatever they find (each prints a line)."""
    _apply(cp, namespace, [nettool_pod("client", ["check", *checks], restartPolicy="Never")])

    def finished() -> Any:  # the pod, once it ended
        pod = _pod(cp, namespace, "client")
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    pod: dict[str, Any] = eventually(finished, "the client pod to finish its checks")
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    return pod


@pytest.fixture(scope="module")
def probe(controlplane: ControlPlane, real_node: RealNode) -> Iterator[Probe]:
    cp = controlplane
    real_node.import_go_image("nettool", NETTOOL_IMAGE)
    namespace = f"t-node-{uuid.uuid4().hex[:6]}"
    cp.create_namespace(namespace)
    _apply(cp, namespace, web_objects())
    web = wait_ready(cp, namespace, "web")
    web_ip = get_json(cp, "service", "web", "-n", namespace)["spec"]["clusterIP"]
    unused = unused_service_ip(cp)
    checks = [
        "get=http://web",
        f"resolve=web.{namespace}.svc.cluster.local",
        "resolve=rlhf-test.invalid",
        "apiserver",
        f"dial={unused}:80",
    ]
    with packet_counters(unused) as count:
        client = _run_client(cp, namespace, checks)
        packets = count()
    logs = cp.kubectl("logs", "client", "-n", namespace).stdout
    results = [json.loads(line) for line in logs.splitlines()]
    yield Probe(
        namespace=namespace,
        web=web,
        web_ip=web_ip,
        web_logs=cp.kubectl("logs", "web", "-n", namespace).stdout,
        client=client,
        checks={r["check"]: r for r in results},
        unused_ip=unused,
        packets=packets,
    )
    cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# --------------------------------------------------------------------------- tests


def test_the_real_node_registers_with_its_label_taint_and_the_machines_capacity(
    controlplane: ControlPlane, real_node: RealNode
) -> None:
    node = get_json(controlplane, "node", REAL_NODE_NAME)
    assert real_node.name == REAL_NODE_NAME
    assert REAL_NODE_LABELS.items() <= node["metadata"]["labels"].items()
    assert REAL_NODE_TAINT in node["spec"]["taints"]
    assert int(node["status"]["capacity"]["cpu"]) == os.cpu_count()
    assert {"type": "InternalIP", "address": NODE_IP} in node["status"]["addresses"]
    # The `kubernetes` Service leads to the API server at the node's address.
    endpoints = get_json(controlplane, "endpointslices", "-n", "default",
                         "-l", "kubernetes.io/service-name=kubernetes")  # fmt: skip
    addresses = {a for s in endpoints["items"] for e in s["endpoints"] for a in e["addresses"]}
    assert addresses == {NODE_IP}


def test_a_pod_runs_on_the_real_node_and_logs(probe: Probe) -> None:
    assert probe.web["spec"]["nodeName"] == REAL_NODE_NAME
    assert ipaddress.ip_address(probe.web["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET)
    assert f"serving on port {PORT}" in probe.web_logs  # read from the kubelet
    assert probe.client["spec"]["nodeName"] == REAL_NODE_NAME


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(probe: Probe) -> None:
    check = probe.checks["apiserver"]
    assert check["ok"], check
    assert json.loads(check["result"])["gitVersion"] == "v1.36.3"


def test_a_pod_reaches_another_through_its_service(probe: Probe) -> None:
    check = probe.checks["get=http://web"]
    assert check == {"check": "get=http://web", "ok": True, "result": "hello from web"}


def test_cluster_dns_answers_cluster_names_and_forwards_nothing(probe: Probe) -> None:
    service = probe.checks[f"resolve=web.{probe.namespace}.svc.cluster.local"]
    assert service["result"] == probe.web_ip
    outside = probe.checks["resolve=rlhf-test.invalid"]
    assert not outside["ok"] and "no such host" in outside["error"]


def test_a_packet_to_an_unused_service_address_is_dropped_not_sent(probe: Probe) -> None:
    check = probe.checks[f"dial={probe.unused_ip}:80"]
    assert not check["ok"] and "timeout" in check["error"], check
    assert probe.packets["PREROUTING"] > 0, "the client's packets never reached the host"
    assert probe.packets["POSTROUTING"] == 0, "a packet to an unserved address went out"
    blackholes = subprocess.run(["ip", "route", "show", "type", "blackhole"],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert SERVICE_CIDR in blackholes


def test_load_image_skips_an_archive_already_imported(
    real_node: RealNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = real_node.import_go_image("nettool", NETTOOL_IMAGE)
    calls: list[tuple[str, ...]] = []
    ctr = real_node.ctr

    def spy(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return ctr(*args, **kwargs)

    monkeypatch.setattr(real_node, "ctr", spy)
    assert real_node.import_go_image("nettool", NETTOOL_IMAGE) == first == [NETTOOL_IMAGE]
    assert not [c for c in calls if c[:2] == ("images", "import")], calls
