"""How a live child differs from its rendering, and the patches that bring it back:
the fields the operator owns after creation, and the worker groups' replica counts."""

from __future__ import annotations

from typing import Any

from rlhf_operator.controller.kube import Obj

# The fields of each child that follow the spec after creation (the rest is fixed at
# creation, like the job's own immutable fields). A field drifts only where the rendered
# value is not already in the live one (`drifted`): the API server fills in defaults
# (a Deployment's strategy and probe timings, a Service's clusterIP and ipFamilies), and
# a merge patch of the rendered value leaves those as they are, so they are no drift.
OWNED_FIELDS = {
    "ConfigMap": ("data",),
    "Role": ("rules",),
    "RoleBinding": ("subjects",),
    "NetworkPolicy": ("spec",),
    "Deployment": ("spec",),  # an environment's: its pods as rendered, and replicas
    "Service": ("spec",),  # its selector and port; clusterIP (immutable) is never patched
    "PodDisruptionBudget": ("spec",),  # an environment's with several replicas
}


def drifted(live: Any, rendered: Any) -> bool:
    """Whether a JSON merge patch of `rendered` would change `live`: a key of a map that
    is missing or differs, a list of another length or with a differing item (a merge
    patch replaces lists whole, so the items are compared the same way). Keys only the
    live object has are the API server's defaults. An empty list or map is what the
    server stores as absent (egress: [] of a policy that allows none)."""
    if isinstance(rendered, dict):
        if live is None and not rendered:
            return False
        return not isinstance(live, dict) or any(
            drifted(live.get(key), value) for key, value in rendered.items()
        )
    if isinstance(rendered, list):
        if live is None and not rendered:
            return False
        return (
            not isinstance(live, list)
            or len(live) != len(rendered)
            or any(drifted(a, b) for a, b in zip(live, rendered, strict=True))
        )
    return bool(live != rendered)


def replica_ops(live: list[Obj], wanted: list[Obj], at: str) -> list[dict[str, Any]]:
    """JSON-patch ops that give each live worker group its wanted replica count; `at` is
    the path of the object holding workerGroupSpecs."""
    wanted_replicas = {g["groupName"]: g["replicas"] for g in wanted}
    ops = []
    for index, group in enumerate(live):
        replicas = wanted_replicas.get(group["groupName"])
        if replicas is None:
            continue
        for field in ("replicas", "minReplicas", "maxReplicas"):
            if group.get(field) != replicas:
                path = f"{at}/workerGroupSpecs/{index}/{field}"
                ops.append({"op": "add", "path": path, "value": replicas})  # add = set
    return ops
