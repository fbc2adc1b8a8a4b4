"""A service the operator runs for a job, an environment or an agent: its Deployment,
headless Service, NetworkPolicy and, with several replicas, PodDisruptionBudget, named
alike and owned by the job (render/environments.py and render/agents.py say what
differs: the command, the probes, who may connect and where it may go).

Such a service runs code the job's user brought, next to the trainer's secrets, so its
pods get the least: restricted Pod Security with a read-only root filesystem, no
service-account token, no service links, none of the job's env or volumes, and only
the ingress and egress its policy names. Pure, like children.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlhf_operator.api.job import RLHFJobSpec
from rlhf_operator.api.job_services import EgressRule
from rlhf_operator.api.podspec import EnvVar, PodResources, Toleration
from rlhf_operator.render.meta import JOB_LABEL, JobRef, Obj, labels, metadata
from rlhf_operator.render.pod import (
    container_resources,
    container_security,
    placement,
    pod_metadata,
    pod_security,
    pod_settings,
)

PORT_NAME = "serve"
HEALTH_PATH = "/healthz"  # every protocol rlhf_env serves answers it once it can serve
# A read-only root filesystem, and Python or a library may still want a scratch place.
SCRATCH = {"name": "tmp", "mountPath": "/tmp"}
SCRATCH_SIZE = "256Mi"  # counts against the ephemeral storage limit below
EPHEMERAL_STORAGE = "512Mi"  # request and limit: logs and /tmp; an eviction names it


class Egress(Protocol):
    """What a service's spec says of its egress (environments[] and agents[] alike):
    render/environments.py's environment_egress renders it."""

    @property
    def egress(self) -> bool | None: ...

    @property
    def egress_to(self) -> list[EgressRule] | None: ...


class ServiceSpec(Protocol):
    """What a service's spec says of its pods (environments[] and agents[] alike)."""

    @property
    def image(self) -> str | None: ...

    @property
    def env(self) -> list[EnvVar] | None: ...

    @property
    def serving_port(self) -> int: ...

    @property
    def replica_count(self) -> int: ...

    @property
    def runtime_class_name(self) -> str | None: ...

    @property
    def node_selector(self) -> dict[str, str] | None: ...

    @property
    def tolerations(self) -> list[Toleration] | None: ...

    def pod_resources(self) -> PodResources: ...


@dataclass(frozen=True)
class JobService:
    """One operator-run service of a job, as its objects are rendered."""

    job: JobRef
    name: str  # its name in the spec (agents[].name)
    spec: ServiceSpec
    component: str  # its pods' app.kubernetes.io/component: not a Ray pod's
    name_label: str  # the label that carries `name` on its pods (rlhf.dev/agent)
    object_name: str  # its Deployment's, Service's and NetworkPolicy's: <job>-agent-<name>
    command: list[str]
    live_path: str = HEALTH_PATH  # what the liveness probe asks
    port_name: str = PORT_NAME

    def selector(self) -> dict[str, str]:
        """The labels of exactly this service's pods (job names are unique in a namespace)."""
        return {JOB_LABEL: self.job.name, self.name_label: self.name}

    def metadata(self) -> Obj:
        return metadata(self.job, self.object_name, self.component)


def render_service_deployment(job_spec: RLHFJobSpec, service: JobService) -> Obj:
    """Its pods, on its image (else the job's), with the job's pull secrets and priority."""
    spec, port = service.spec, service.port_name
    container: Obj = {
        "name": service.component,
        "image": spec.image or job_spec.image,
        "imagePullPolicy": job_spec.image_pull_policy,
        "command": service.command,
        "ports": [{"name": port, "containerPort": spec.serving_port, "protocol": "TCP"}],
        # Ready once it answers; restarted when it has not been live for a minute.
        "readinessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": port},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": service.live_path, "port": port},
            "periodSeconds": 10,
            "timeoutSeconds": 10,  # more than rlhf_env's own probe of its threads (5 s)
            "failureThreshold": 6,
        },
        "resources": container_resources(
            spec.pod_resources(), {"ephemeral-storage": EPHEMERAL_STORAGE}
        ),
        "securityContext": {**container_security(), "readOnlyRootFilesystem": True},
        "volumeMounts": [SCRATCH],
    }
    if spec.env:  # none of the job's pods.env: it may hold the trainer's secrets
        container["env"] = [e.to_dict() for e in spec.env]
    pod: Obj = {
        "automountServiceAccountToken": False,  # it never talks to the API server
        "enableServiceLinks": False,  # no variables naming the namespace's other Services
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": [{"name": SCRATCH["name"], "emptyDir": {"sizeLimit": SCRATCH_SIZE}}],
        **pod_settings(job_spec),  # pull secrets and priority, as the job's other pods
        **placement(spec.node_selector, spec.tolerations, None),
    }
    if spec.runtime_class_name is not None:  # a sandbox (gVisor, Kata) for its code
        pod["runtimeClassName"] = spec.runtime_class_name
    pod_labels = {**labels(service.job, service.component), service.name_label: service.name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": service.metadata(),
        "spec": {
            "replicas": spec.replica_count,
            "selector": {"matchLabels": service.selector()},
            "template": {"metadata": pod_metadata(job_spec, pod_labels), "spec": pod},
        },
    }


def render_service_service(service: JobService) -> Obj:
    """The name the trainer reaches it at. Headless: the name resolves to each ready
    replica's address, and the trainer places each session (episode) on a replica
    (rlhf_env.replicas), the next one when a replica is full (503) or gone."""
    port, name = service.spec.serving_port, service.port_name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": service.metadata(),
        "spec": {
            "clusterIP": "None",
            "selector": service.selector(),
            "ports": [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}],
        },
    }


def render_service_policy(service: JobService, clients: Obj, egress: list[Obj]) -> Obj:
    """Ingress from `clients` (a pod selector of the job's) on its port only; egress
    what `egress` lists (none: nothing, DNS included)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": service.metadata(),
        "spec": {
            "podSelector": {"matchLabels": service.selector()},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [{"podSelector": clients}],
                    "ports": [{"protocol": "TCP", "port": service.spec.serving_port}],
                }
            ],
            "egress": egress,
        },
    }


def render_service_disruption_budget(service: JobService) -> list[Obj]:
    """With several replicas, a drain takes one at a time: what one replica held starts
    again on the others (rlhf_env.replicas) while the rest serve. One replica has none: a
    drain must not wait on it. A budget left from more replicas is harmless."""
    if service.spec.replica_count < 2:
        return []
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": service.metadata(),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": service.selector()}},
        }
    ]
