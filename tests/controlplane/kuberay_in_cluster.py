"""KubeRay as production runs it: inside the cluster, a pod on the real node, from an
image of the very binary the tests build (static, go/kuberay), installed with KubeRay's
own Deployment and RBAC (its module's config/default, rendered by kubectl's kustomize).

Inside the cluster KubeRay reaches each head's dashboard over the pod network, by the
head Service's DNS name; the KubeRay on this machine goes through the API server's
service proxy instead (harness._start_kuberay). That one stops while this one runs:
two would reconcile the same RayJobs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from . import demo
from .harness import GO_DIR, ControlPlane, go_module_dir
from .util import eventually, get_json

NAMESPACE = "ray-system"
IMAGE = "rlhf.local/kuberay-operator:1"
BINARY = "kuberay-operator"  # in tests/controlplane/bin, and at / in the image
UID = 65532  # the image has no user of its own, and the namespace refuses root


def manifests(cp: ControlPlane) -> list[dict[str, Any]]:
    """KubeRay's own config/default, without its CRDs (the control plane has them), in
    NAMESPACE, running IMAGE."""
    module = go_module_dir(GO_DIR / "kuberay", "github.com/ray-project/kuberay/ray-operator")
    default = module / "config" / "default"
    rendered = cp.kubectl("kustomize", str(default)).stdout
    objects = [
        o for o in yaml.safe_load_all(rendered) if o and o["kind"] != "CustomResourceDefinition"
    ]
    for obj in objects:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            obj["metadata"]["namespace"] = NAMESPACE
        for subject in obj.get("subjects", []):
            subject["namespace"] = NAMESPACE
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]["spec"]
            pod["securityContext"] |= {"runAsUser": UID, "runAsGroup": UID}
            (container,) = pod["containers"]
            container |= {"image": IMAGE, "imagePullPolicy": "Never", "command": [f"/{BINARY}"]}
            # The walk-through's pods ask for all of the node's 2 cores but 100m, and
            # its submitter would not fit beside KubeRay's request: it asks for no CPU
            # here (its limit stays).
            container["resources"]["requests"]["cpu"] = "0"
    return objects


def kuberay_pods(cp: ControlPlane) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = get_json(
        cp, "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=kuberay"
    )["items"]
    return pods


@contextmanager
def kuberay_in_cluster(cp: ControlPlane) -> Iterator[dict[str, Any]]:
    """KubeRay running in the cluster for the body, in place of the one on this machine;
    yields its pod, once ready."""
    assert cp.real_node is not None
    cp.real_node.import_go_image(BINARY, IMAGE)
    demo.real_node_namespace(cp, NAMESPACE)
    objects = yaml.safe_dump_all(manifests(cp))
    with cp.host_kuberay_stopped():
        cp.kubectl("apply", "-f", "-", input=objects)
        try:

            def ready() -> dict[str, Any] | None:
                for pod in kuberay_pods(cp):
                    conditions = pod["status"].get("conditions", [])
                    if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                        return pod
                return None

            yield eventually(ready, "KubeRay's pod ready in the cluster", timeout=180)
        finally:
            cp.kubectl("delete", "--wait=true", "--timeout=60s", "-f", "-", input=objects,
                       check=False)  # fmt: skip
