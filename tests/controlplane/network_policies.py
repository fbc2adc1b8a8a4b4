"""NetworkPolicies enforced on the real node, as a cluster with a policy-enforcing network
plugin does: kube-network-policies (go/netpol), a pod on the real node from an image of
the binary the tests build, installed with its module's own install.yaml.

The bridge CNI enforces nothing by itself. The enforcer sends each new connection to or
from a pod that a policy selects to a userspace queue, and drops what no policy admits
(it evaluates after DNAT, at POSTROUTING; br_netfilter puts bridged traffic there too).
Traffic that root's processes on the machine send is never queued, as the enforcer
intends (kubelet probes): the host's KubeRay, Prometheus and the tests' kubectl pass.

It runs with --fail-open: a test that kills it, or a run that dies with it, leaves rules
whose packets pass, not a node that drops every pod's traffic for the next test."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import yaml

from .harness import GO_DIR, ControlPlane, go_module_dir
from .node import on_real_node
from .util import eventually, get_json

NAMESPACE = "kube-system"  # install.yaml's; the enforcer is privileged, on the host's network
IMAGE = "rlhf.local/kube-network-policies:1"
BINARY = "kube-network-policies"  # in tests/controlplane/bin, and at / in the image
LABEL = "app=kube-network-policies"  # its pods' (install.yaml)
SYNCED = "Syncing nftables rules"  # its log line as it writes its rules
SYNC_FAILED = "syncing nftables rules"  # and as the kernel refuses them (with the error)


def manifests(cp: ControlPlane) -> list[dict[str, Any]]:
    """Its module's install.yaml, running IMAGE on the real node."""
    module = go_module_dir(GO_DIR / "netpol", "sigs.k8s.io/kube-network-policies")
    objects = [o for o in yaml.safe_load_all((module / "install.yaml").read_text()) if o]
    server = urlsplit(cp.server)
    for obj in objects:
        if obj["kind"] != "DaemonSet":
            continue
        pod = obj["spec"]["template"]["spec"] = on_real_node(obj["spec"]["template"]["spec"])
        (container,) = pod["containers"]
        container |= {
            "image": IMAGE,
            "imagePullPolicy": "Never",
            "command": [f"/{BINARY}"],
            "args": [
                "--hostname-override=$(MY_NODE_NAME)",
                "--v=2",
                "--nfqueue-id=98",
                "--fail-open",
                # Pod IPs from the API server: this node's containerd has no NRI socket.
                "--disable-nri",
                # A DNS race that kernels from 6.12 fixed; the node's is newer.
                "--netfilter-bug-1766-fix=false",
                "--metrics-bind-address=127.0.0.1:0",  # the host's ports are the tests'
            ],
            # On the host's network, a ClusterIP is not reachable from this node (its
            # Service range is a blackhole route, met before kube-proxy's DNAT), so the
            # enforcer is pointed at the API server's own address.
            "env": [
                *container["env"],
                {"name": "KUBERNETES_SERVICE_HOST", "value": server.hostname},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(server.port)},
            ],
        }
        # The walk-through's pods ask for all of the node's 2 cores but 100m, which KubeRay's
        # submitter then needs (kuberay_in_cluster): no CPU asked here either.
        container["resources"]["requests"]["cpu"] = "0"
        container.pop("volumeMounts")  # NRI's socket and the netns: unused without NRI
        pod.pop("volumes")
    return objects


def enforcer_log(cp: ControlPlane, pod: dict[str, Any]) -> str:
    """Its log: at --v=2, a line per connection it judged, ending verdict="accept" or
    verdict="drop" ("" if the pod has none yet)."""
    return cp.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], check=False).stdout


@contextmanager
def network_policies_enforced(cp: ControlPlane) -> Iterator[dict[str, Any]]:
    """The enforcer running on the real node for the body; yields its pod once it has
    written its rules."""
    assert cp.real_node is not None
    # It removes its rules on SIGINT only (cmd/main.go), so the image says to stop it so.
    cp.real_node.import_go_image(BINARY, IMAGE, stop_signal="SIGINT")
    objects = yaml.safe_dump_all(manifests(cp))
    cp.kubectl("apply", "-f", "-", input=objects)
    try:

        def synced() -> dict[str, Any] | None:
            for pod in get_json(cp, "pods", "-n", NAMESPACE, "-l", LABEL)["items"]:
                if pod["status"].get("phase") != "Running":
                    continue
                log = enforcer_log(cp, pod)
                assert SYNC_FAILED not in log, log[-3000:]
                if SYNCED in log:
                    return pod
            return None

        yield eventually(synced, "the NetworkPolicy enforcer's rules written", timeout=120)
    finally:
        # It removes its rules as it stops: the pod goes before its DaemonSet
        # (foreground), and --wait waits for both, so the rules are gone at the return.
        cp.kubectl("delete", "--cascade=foreground", "--wait=true", "--timeout=90s",
                   "-f", "-", input=objects, check=False)  # fmt: skip


def dials(cp: ControlPlane, namespace: str, client: str, targets: list[str]) -> dict[str, bool]:
    """Which of `targets` (HOST:PORT) `client`, a nettool pod, connects to from inside
    (kubectl exec; nettool's dial: 3 s, then a timeout: the enforcer drops a refused
    connection's first packet)."""
    checks = [f"dial={target}" for target in targets]
    out = cp.kubectl("exec", "-n", namespace, client, "--", "/nettool", "check", *checks).stdout
    found = {r["check"]: r["ok"] for r in map(json.loads, out.splitlines())}
    return {target: found[f"dial={target}"] for target in targets}


# What a Proof's dials found: the client's, by target name; the others', by client name.
Dialled = tuple[dict[str, bool], dict[str, bool]]


@dataclass(frozen=True)
class Proof:
    """A policy's proof by dials, each from inside a pod: from `client` to each of
    `targets` (name -> HOST:PORT), and from each of `others` to `guarded` (HOST:PORT)."""

    namespace: str
    client: str
    targets: dict[str, str]
    others: tuple[str, ...]
    guarded: str

    def dial(self, cp: ControlPlane) -> Dialled:
        found = dials(cp, self.namespace, self.client, list(self.targets.values()))
        guarded = {
            c: dials(cp, self.namespace, c, [self.guarded])[self.guarded] for c in self.others
        }
        return {name: found[target] for name, target in self.targets.items()}, guarded


@dataclass(frozen=True)
class Enforced:
    """A proof's dials before its policies and after, the enforcer's pod and its log."""

    before: Dialled
    after: Dialled
    enforcer: dict[str, Any]
    log: str


def dialled_across(
    cp: ControlPlane,
    proof: Proof,
    policies: list[dict[str, Any]],
    in_place: Callable[[Dialled], bool],
    what: str,
) -> Enforced:
    """The proof's dials with the enforcer running, before `policies` exist (once its
    client reaches every target: what is refused afterwards is refused by the policies)
    and after they are applied, once `in_place` says of the dials that the enforcer wrote
    their rules (it writes them as the policies arrive; `what` names the wait)."""
    with network_policies_enforced(cp) as enforcer:
        eventually(lambda: all(proof.dial(cp)[0].values()), "every target reached before")
        before = proof.dial(cp)
        cp.kubectl("apply", "-n", proof.namespace, "-f", "-", input=yaml.safe_dump_all(policies))
        eventually(lambda: in_place(proof.dial(cp)), what)
        return Enforced(before, proof.dial(cp), enforcer, enforcer_log(cp, enforcer))
