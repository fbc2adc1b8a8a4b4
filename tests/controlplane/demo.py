"""What `make cluster` prepares so that a person can run a real job on the real node, and
the docs' walk-through (docs/getting-started/cluster.md) with them: the images in the
node's containerd, the namespaces
`rlhf-system` (the operator) and `demo` (jobs), and the claim the CPU example keeps its
checkpoints on.

The real node is tainted so that the fake nodes' pods never land on it. The two
namespaces send their pods there through admission, as a platform sends a team's pods to
its node group: the API server's PodNodeSelector adds the node's label to every pod's
nodeSelector and PodTolerationRestriction adds the toleration of its taint. So the
chart and the examples apply unchanged. Both namespaces enforce the restricted Pod
Security level."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.images.build import VERSION, ensure
from tests.images.load import load

from .harness import ControlPlane
from .node import REAL_NODE_LABEL_KEY, REAL_NODE_TOLERATION, RealNode
from .util import bound_claim

OPERATOR_NAMESPACE = "rlhf-system"
JOBS_NAMESPACE = "demo"
OPERATOR_IMAGE = f"rlhf-operator:{VERSION}"
TRAINER_IMAGE = f"rlhf-trainer:{VERSION}-cpu"
CHECKPOINT_CLAIM = "checkpoints"  # examples/cpu-cluster.yaml's checkpointClaim
ON_REAL_NODE = {
    "scheduler.alpha.kubernetes.io/node-selector": f"{REAL_NODE_LABEL_KEY}=true",
    "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps([REAL_NODE_TOLERATION]),
}


# The names the chart and the examples use for the images of tests/images/build.py.
IMAGE_NAMES = {
    "operator": OPERATOR_IMAGE,
    "trainer-cpu": TRAINER_IMAGE,
    "environment": f"rlhf-environment:{VERSION}",
}


def load_images(node: RealNode, images: tuple[str, ...] = ("operator", "trainer-cpu")) -> None:
    """`images` (tests/images/build.py's names), built if stale (cached by their inputs)
    and put into the node's containerd under the names the chart and the examples use."""
    built = ensure(images)
    socket = str(node.layout.containerd_socket)
    for image in images:
        load(built[image], socket, name=IMAGE_NAMES[image])


def real_node_namespace(cp: ControlPlane, name: str) -> None:
    """A restricted namespace whose pods all run on the real node."""
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "annotations": ON_REAL_NODE,
            "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
        },
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(namespace))
    cp.wait_for_default_service_account(name)


def checkpoint_claim(cp: ControlPlane, namespace: str) -> Path:
    """The CPU example's claim in `namespace`, bound to a new directory of this run (on
    the real node's machine) that the trainer image's user (uid 1000) may write: every
    pod of a job on this one node shares it, as pods on many nodes share a ReadWriteMany
    volume. New, so that a job does not resume from another run's checkpoints."""
    directory = cp.run_dir / "volumes" / f"{namespace}-{CHECKPOINT_CLAIM}"
    directory.mkdir(parents=True)
    directory.chmod(0o777)
    objects = bound_claim(namespace, CHECKPOINT_CLAIM, str(directory), "ReadWriteMany")
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    return directory


def prepare(cp: ControlPlane) -> Path:
    """Everything the walk-through needs beyond the control plane (seconds, once the
    images are built and loaded); returns the directory behind the jobs' claim."""
    if cp.real_node is None:
        raise RuntimeError(f"no real node: {cp.real_node_absent}")
    load_images(cp.real_node)
    for namespace in (OPERATOR_NAMESPACE, JOBS_NAMESPACE):
        real_node_namespace(cp, namespace)
    return checkpoint_claim(cp, JOBS_NAMESPACE)
