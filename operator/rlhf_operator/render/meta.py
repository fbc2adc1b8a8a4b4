"""What every child of a job carries: its name, namespace, labels and the owner
reference to the job, so the garbage collector removes it with the job; and the label
selectors of the job's pods by kind (head, worker, submitter, environment)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_operator.api.job import API_VERSION, GROUP, KIND

Obj = dict[str, Any]

JOB_LABEL = f"{GROUP}/job"
# Which part of the job a pod is. A job's pods.labels may not set it (a reserved key), so
# a NetworkPolicy can tell the Ray pods from the environments' pods by it.
COMPONENT_LABEL = "app.kubernetes.io/component"
RAY_POD_COMPONENTS = ("head", "worker")  # the driver, and the pools' workers
JOB_POD_COMPONENTS = (*RAY_POD_COMPONENTS, "submitter")  # `ray job submit` to the head


@dataclass(frozen=True)
class JobRef:
    """Identity of the RLHFJob that owns the rendered objects."""

    name: str
    namespace: str
    uid: str

    @property
    def spec_configmap(self) -> str:
        return f"{self.name}-spec"

    @property
    def reporter(self) -> str:
        return f"{self.name}-reporter"

    @property
    def rayjob(self) -> str:
        return self.name


def labels(job: JobRef, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rlhf-trainer",
        "app.kubernetes.io/instance": job.name,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/managed-by": "rlhf-operator",
        JOB_LABEL: job.name,
    }


def metadata(job: JobRef, name: str, component: str) -> Obj:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels(job, component),
        "ownerReferences": [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": job.name,
                "uid": job.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def pods_of(job: JobRef, components: tuple[str, ...]) -> Obj:
    """A label selector of the job's pods of these components."""
    return {
        "matchLabels": {JOB_LABEL: job.name},
        "matchExpressions": [
            {"key": COMPONENT_LABEL, "operator": "In", "values": list(components)}
        ],
    }
