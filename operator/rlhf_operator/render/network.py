"""Who may reach a job's pods, when the platform asks for NetworkPolicies.

The chart's `networkPolicy` values reach the operator as JSON in RLHF_NETWORK_POLICY:
where Prometheus runs, where KubeRay's operator runs, and where this operator runs. Each
job then gets a policy that admits its own pods (Ray's GCS, object transfers and NCCL
use many ports), and the others to the few ports they need, and nothing else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

ENV = "RLHF_NETWORK_POLICY"
RAY_DASHBOARD_PORT = 8265  # KubeRay's operator asks the head for the job's state here
RAY_METRICS_PORT = 8080  # Ray's own metrics on every pod (KubeRay's --metrics-export-port)


@dataclass(frozen=True)
class NetworkAccess:
    prometheus: Obj  # a NetworkPolicyPeer: {namespaceSelector, podSelector}
    kuberay: Obj  # a NetworkPolicyPeer
    # The operator's own pods: they ask the head how a Ray job ended when KubeRay's
    # verdict came late (controller/restarts.py), on the dashboard port as KubeRay does.
    operator: Obj | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> NetworkAccess | None:
        """None when the platform did not ask for policies."""
        raw = environ.get(ENV)
        if not raw:
            return None
        try:
            peers = json.loads(raw)
            operator = dict(peers["operator"]) if peers.get("operator") else None
            return cls(dict(peers["prometheus"]), dict(peers["kuberay"]), operator)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{ENV} must be a JSON object with NetworkPolicy peers 'prometheus' and "
                f"'kuberay', got {raw!r}: {error!r}"
            ) from error


def render_network_policy(
    meta: Obj, job_pods: Obj, access: NetworkAccess, trainer_metrics_port: int
) -> Obj:
    """`job_pods`: the label selector of every pod of the job."""

    def tcp(*ports: int) -> list[Obj]:
        return [{"protocol": "TCP", "port": port} for port in ports]

    dashboard_peers = [access.kuberay, *([access.operator] if access.operator else [])]

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": job_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": job_pods}]},
                {"from": [access.prometheus], "ports": tcp(trainer_metrics_port, RAY_METRICS_PORT)},
                {"from": dashboard_peers, "ports": tcp(RAY_DASHBOARD_PORT)},
            ],
        },
    }
