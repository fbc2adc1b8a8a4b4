"""Who may reach a job's pods, and where its environments' pods may go.

The chart's `networkPolicy` values reach the operator as JSON in two variables:
- RLHF_NETWORK_POLICY, only with networkPolicy.enabled: where Prometheus, KubeRay's
  operator and this operator run (`Peers`). Each job then gets a policy that admits its
  own pods (Ray's GCS, object transfers and NCCL use many ports), and the others to the
  few ports they need, and nothing else.
- RLHF_CLUSTER_NETWORK, always: the cluster's own address ranges, the metadata
  addresses and the DNS pods. An environment with `egress: true` reaches every address
  but those ranges and the metadata addresses, and DNS.

Without the peers, a job any of whose environments (agents) has egress still gets a
policy: one that admits everything but environments' and agents' pods
(`render_environment_guard`).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The clouds' instance metadata: the chart's networkPolicy.metadataAddresses default.
from rlhf_operator.api.environments import METADATA_ADDRESSES

Obj = dict[str, Any]

ENV = "RLHF_NETWORK_POLICY"
CLUSTER_ENV = "RLHF_CLUSTER_NETWORK"
RAY_DASHBOARD_PORT = 8265  # KubeRay's operator asks the head for the job's state here
RAY_METRICS_PORT = 8080  # Ray's own metrics on every pod (KubeRay's --metrics-export-port)
# The chart's networkPolicy.clusterRanges default: the private, shared (CGNAT) and
# link-local ranges pod, Service and node addresses are commonly taken from.
CLUSTER_RANGES = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "fc00::/7",
    "fe80::/10",
)
# The chart's networkPolicy.dns default: the cluster DNS pods (CoreDNS and kube-dns both
# carry k8s-app: kube-dns).
KUBE_DNS: Obj = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}
DNS_PORTS = ({"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53})


@dataclass(frozen=True)
class Peers:
    """Where the platform's parts run, as NetworkPolicyPeers ({namespaceSelector,
    podSelector})."""

    prometheus: Obj
    kuberay: Obj
    # The operator's own pods: they ask the head how a Ray job ended when KubeRay's
    # verdict came late (controller/restarts.py), on the dashboard port as KubeRay does.
    operator: Obj | None = None


@dataclass(frozen=True)
class NetworkAccess:
    peers: Peers | None = None  # None: the chart's networkPolicy.enabled is false
    cluster_ranges: tuple[str, ...] = CLUSTER_RANGES  # pod, Service (and node) ranges
    dns: tuple[Obj, ...] = field(default=(KUBE_DNS,))  # NetworkPolicyPeers
    # Taken out of every egress rule of an environment, whatever the ranges say.
    metadata: tuple[str, ...] = METADATA_ADDRESSES

    def internet(self) -> list[Obj]:
        """ipBlock peers of every address but the cluster's and the metadata's."""
        return internet(self.cluster_ranges, self.metadata)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> NetworkAccess:
        """The chart's values; the defaults where a variable is unset."""
        peers = _peers(environ.get(ENV))
        raw = environ.get(CLUSTER_ENV)
        if not raw:
            return cls(peers)
        try:
            values = json.loads(raw)
            ranges = tuple(str(_network(r)) for r in values["clusterRanges"])
            dns = tuple(dict(peer) for peer in values["dns"])
            given = values.get("metadataAddresses", METADATA_ADDRESSES)
            metadata = tuple(str(_network(a)) for a in given)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{CLUSTER_ENV} must be a JSON object with 'clusterRanges' (a list of CIDRs), "
                f"'dns' (a list of NetworkPolicy peers) and optionally 'metadataAddresses' "
                f"(a list of CIDRs), got {raw!r}: {error}"
            ) from error
        return cls(peers, ranges, dns, metadata)


def _peers(raw: str | None) -> Peers | None:
    if not raw:
        return None
    try:
        peers = json.loads(raw)
        operator = dict(peers["operator"]) if peers.get("operator") else None
        return Peers(dict(peers["prometheus"]), dict(peers["kuberay"]), operator)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{ENV} must be a JSON object with NetworkPolicy peers 'prometheus' and "
            f"'kuberay', got {raw!r}: {error!r}"
        ) from error


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _network(cidr: str) -> Network:
    return ipaddress.ip_network(cidr, strict=True)


def render_network_policy(meta: Obj, job_pods: Obj, peers: Peers, trainer_metrics_port: int) -> Obj:
    """`job_pods`: the label selector of every pod of the job."""

    def tcp(*ports: int) -> list[Obj]:
        return [{"protocol": "TCP", "port": port} for port in ports]

    dashboard_peers = [peers.kuberay, *([peers.operator] if peers.operator else [])]
    return _ingress_policy(
        meta,
        job_pods,
        [
            {"from": [{"podSelector": job_pods}]},
            {"from": [peers.prometheus], "ports": tcp(trainer_metrics_port, RAY_METRICS_PORT)},
            {"from": dashboard_peers, "ports": tcp(RAY_DASHBOARD_PORT)},
        ],
    )


def render_environment_guard(
    meta: Obj, job_pods: Obj, service_labels: Sequence[str], cluster_ranges: Sequence[str]
) -> Obj:
    """The job's policy where the platform named no peers: its pods admit every pod but
    the environments' and agents' (of any job: pods carrying one of `service_labels`), and
    every address outside `cluster_ranges`.

    Policies only add what they allow, so admitting "all but" takes a pod selector: an
    ipBlock is the portable peer only for addresses outside the cluster (some plugins
    match pod addresses against it, as Calico does; others never, as Cilium), hence the
    cluster's ranges excepted. A source in those ranges that is no pod (another node's
    host network, a NodePort's SNAT) is refused then: give the chart's peers instead.
    The pod's own node is admitted whatever the policy (kubelet probes)."""
    not_services = {
        "namespaceSelector": {},
        "podSelector": {
            "matchExpressions": [{"key": k, "operator": "DoesNotExist"} for k in service_labels]
        },
    }
    outside = internet(cluster_ranges, ())
    return _ingress_policy(meta, job_pods, [{"from": [not_services, *outside]}])


def _ingress_policy(meta: Obj, pods: Obj, ingress: list[Obj]) -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def internet(ranges: Sequence[str], metadata: Sequence[str] = METADATA_ADDRESSES) -> list[Obj]:
    """ipBlock peers of every address but `ranges` and `metadata`, one per address
    family (none for a family they cover whole)."""
    wholes = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
    excluded = (*ranges, *metadata)
    return [{"ipBlock": block} for whole in wholes if (block := _block(whole, excluded))]


def allowed_block(cidr: str, metadata: Sequence[str] = METADATA_ADDRESSES) -> Obj | None:
    """An ipBlock peer of `cidr` without the `metadata` addresses; None if it holds
    nothing else."""
    block = _block(_network(cidr), metadata)
    return None if block is None else {"ipBlock": block}


def _block(whole: Network, excluded: Sequence[str]) -> Obj | None:
    """{cidr, except}: `whole` but the networks of `excluded` inside it, merged (an
    except must lie strictly inside the cidr, and in its family); None when one of them
    covers `whole`."""
    same_family = [n for n in map(_network, excluded) if n.version == whole.version]
    if any(_within(whole, n) for n in same_family):
        return None
    inside = [n for n in same_family if _within(n, whole)]
    block: Obj = {"cidr": str(whole)}
    if inside:
        block["except"] = [str(n) for n in ipaddress.collapse_addresses(inside)]  # type: ignore[type-var]
    return block


def _within(inner: Network, outer: Network) -> bool:
    return inner.subnet_of(outer)  # type: ignore[arg-type]  # same family: checked by callers


def dns_rule(dns: Sequence[Obj]) -> Obj:
    """An egress rule to the cluster DNS: names resolve, nothing else is asked there."""
    return {"to": list(dns), "ports": [dict(p) for p in DNS_PORTS]}
