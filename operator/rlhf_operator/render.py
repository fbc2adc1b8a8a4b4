"""Pure rendering: an RLHFJob's spec -> the Kubernetes objects it owns.

No API calls here; the reconciler decides what to create or patch. Every child has a
name derived from the job's, the job's labels and an owner reference, so the garbage
collector removes it with the job and a re-render always names the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_operator.api import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    PodResources,
    Pool,
    RLHFJobSpec,
    Separation,
    Toleration,
)
from rlhf_operator.render_network import NetworkAccess, render_network_policy
from rlhf_trainer.api.names import POOL_LABEL, pool_resource

Obj = dict[str, Any]

RAY_VERSION = "2.60.0"  # the Ray in the trainer image (a test keeps it equal to the pin)
SPEC_MOUNT = "/etc/rlhf"
SPEC_FILE = "spec.json"
# The driver runs in the head pod (KubeRay submits the entrypoint there) and serves
# the trainer's metrics on this port.
TRAINER_METRICS_PORT = 9400
ENTRYPOINT = (
    f"python -m rlhf_trainer --spec {SPEC_MOUNT}/{SPEC_FILE} --metrics-port {TRAINER_METRICS_PORT}"
)
RUN_AS_USER = 1000  # the trainer image's non-root user

JOB_LABEL = f"{GROUP}/job"
HEAD_DEFAULTS = PodResources(cpu=2, memory="8Gi")


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


def render_children(
    job: JobRef, spec: RLHFJobSpec, network: NetworkAccess | None = None
) -> list[Obj]:
    """Every object the job owns, in creation order (the RayJob's dependencies first);
    with `network`, a NetworkPolicy that admits only what the job needs."""
    policy = []
    if network is not None:
        meta = metadata(job, job.name, "network")
        job_pods = {"matchLabels": {JOB_LABEL: job.name}}
        policy = [render_network_policy(meta, job_pods, network, TRAINER_METRICS_PORT)]
    return [
        render_spec_configmap(job, spec),
        *render_reporter_rbac(job),
        *policy,
        render_rayjob(job, spec),
    ]


def labels(job: JobRef, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rlhf-trainer",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/component": component,
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


def render_spec_configmap(job: JobRef, spec: RLHFJobSpec) -> Obj:
    """The validated trainer-facing spec, mounted into every Ray pod."""
    config = spec.job_config().model_dump_json(by_alias=True, exclude_none=True, indent=1)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, job.spec_configmap, "spec"),
        "data": {SPEC_FILE: config},
    }


def render_reporter_rbac(job: JobRef) -> list[Obj]:
    """An identity for the driver that may patch this job's status and nothing else."""
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(job, job.reporter, "reporter"),
            "automountServiceAccountToken": False,  # mounted explicitly into the head only
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(job, job.reporter, "reporter"),
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": [f"{PLURAL}/status"],
                    "resourceNames": [job.name],
                    "verbs": ["get", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(job, job.reporter, "reporter"),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": job.reporter,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": job.reporter, "namespace": job.namespace}
            ],
        },
    ]


def render_rayjob(job: JobRef, spec: RLHFJobSpec) -> Obj:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": metadata(job, job.rayjob, "rayjob"),
        "spec": {
            "entrypoint": ENTRYPOINT,
            "suspend": spec.suspend,
            # Free the GPUs as soon as training ends; status stays on the RLHFJob.
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 60,
            "backoffLimit": 0,  # the trainer resumes from checkpoints; no blind resubmits
            "submitterPodTemplate": _submitter_template(job, spec),
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": False,
                "headGroupSpec": _head_group(job, spec),
                "workerGroupSpecs": [_worker_group(job, spec, pool) for pool in spec.pools],
            },
        },
    }


def _head_group(job: JobRef, spec: RLHFJobSpec) -> Obj:
    head = spec.head
    pod: Obj = {
        "serviceAccountName": job.reporter,
        "automountServiceAccountToken": True,  # the driver patches the job's status
        "securityContext": _pod_security(),
        "containers": [
            {
                "name": "ray-head",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "env": _job_env(job),
                "ports": [
                    {"name": "metrics", "containerPort": TRAINER_METRICS_PORT, "protocol": "TCP"}
                ],
                "resources": _container_resources(head.resources or HEAD_DEFAULTS),
                "securityContext": _container_security(),
                "volumeMounts": _mounts(spec),
            }
        ],
        "volumes": _volumes(job, spec),
        **_placement(head.node_selector, head.tolerations, None),
    }
    return {
        # No Ray work on the head: it runs the driver; GPU work goes to the pools.
        "rayStartParams": {"num-cpus": "0"},
        "template": {
            "metadata": {
                "labels": labels(job, "head"),
                # For Prometheus' pod discovery (the chart's PodMonitor selects the label).
                "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(TRAINER_METRICS_PORT),
                },
            },
            "spec": pod,
        },
    }


def _worker_group(job: JobRef, spec: RLHFJobSpec, pool: Pool) -> Obj:
    pod_labels = {**labels(job, "worker"), POOL_LABEL: pool.name}
    gpus = str(pool.gpus_per_node)
    resources = _container_resources(pool.resources or PodResources())
    resources["limits"][pool.gpu_resource] = gpus
    resources["requests"][pool.gpu_resource] = gpus
    pod: Obj = {
        "automountServiceAccountToken": False,  # workers never talk to the API server
        "securityContext": _pod_security(),
        "containers": [
            {
                "name": "ray-worker",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "env": _job_env(job),
                "resources": resources,
                "securityContext": _container_security(),
                "volumeMounts": _mounts(spec),
            }
        ],
        "volumes": _volumes(job, spec),
        **_placement(pool.node_selector, pool.tolerations, _pool_affinity(job, spec, pool)),
    }
    return {
        "groupName": pool.name,
        "replicas": pool.replicas,
        "minReplicas": pool.replicas,
        "maxReplicas": pool.replicas,
        "numOfHosts": 1,
        "rayStartParams": {},
        # Ray sees the pool's GPUs and a resource named after the pool, so the trainer
        # can place each role's workers onto the pool it is mapped to.
        "resources": {"GPU": gpus, pool_resource(pool.name): gpus},
        "labels": {POOL_LABEL: pool.name},
        "template": {"metadata": {"labels": pod_labels}, "spec": pod},
    }


def _pool_affinity(job: JobRef, spec: RLHFJobSpec, pool: Pool) -> Obj | None:
    """The pool's own affinity, plus, with separation: node, a rule that no node hosts
    a worker of another pool of this job."""
    affinity: Obj = {key: value for key, value in (pool.affinity or {}).items()}
    if spec.separation is Separation.NODE and len(spec.pools) > 1:
        anti = dict(affinity.get("podAntiAffinity", {}))
        required = list(anti.get("requiredDuringSchedulingIgnoredDuringExecution", []))
        required.append(
            {
                "labelSelector": {
                    "matchExpressions": [
                        {"key": JOB_LABEL, "operator": "In", "values": [job.name]},
                        {"key": POOL_LABEL, "operator": "Exists"},
                        {"key": POOL_LABEL, "operator": "NotIn", "values": [pool.name]},
                    ]
                },
                "topologyKey": "kubernetes.io/hostname",
            }
        )
        anti["requiredDuringSchedulingIgnoredDuringExecution"] = required
        affinity["podAntiAffinity"] = anti
    return affinity or None


def _placement(
    node_selector: dict[str, str] | None, tolerations: list[Toleration] | None, affinity: Obj | None
) -> Obj:
    out: Obj = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = [t.to_dict() for t in tolerations]
    if affinity:
        out["affinity"] = affinity
    return out


def _submitter_template(job: JobRef, spec: RLHFJobSpec) -> Obj:
    # KubeRay fills in the `ray job submit` command; we set who it runs as.
    return {
        "metadata": {"labels": labels(job, "submitter")},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": _pod_security(),
            "containers": [
                {
                    "name": "ray-job-submitter",
                    "image": spec.image,
                    "imagePullPolicy": spec.image_pull_policy,
                    "resources": _container_resources(PodResources(cpu="500m", memory="512Mi")),
                    "securityContext": _container_security(),
                }
            ],
            **_placement(spec.head.node_selector, spec.head.tolerations, None),
        },
    }


def _job_env(job: JobRef) -> list[Obj]:
    # The driver reports progress to its RLHFJob; the namespace comes from the pod.
    return [
        {"name": "RLHF_JOB_NAME", "value": job.name},
        {
            "name": "RLHF_JOB_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
    ]


def _container_resources(resources: PodResources) -> Obj:
    """Requests equal limits for CPU and memory: GPU pods should be Guaranteed QoS."""
    amounts = {
        k: str(v)
        for k, v in (("cpu", resources.cpu), ("memory", resources.memory))
        if v is not None
    }
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _mounts(spec: RLHFJobSpec) -> list[Obj]:
    mounts: list[Obj] = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.checkpoint_claim:
        mounts.append({"name": "checkpoints", "mountPath": spec.trainer.checkpoint.path})
    return mounts


def _volumes(job: JobRef, spec: RLHFJobSpec) -> list[Obj]:
    volumes: list[Obj] = [
        {"name": "spec", "configMap": {"name": job.spec_configmap}},
        # NCCL and Ray's object store need a large /dev/shm (the default is 64 MiB).
        # Memory-backed, it counts against the pod's memory limit, which bounds it.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    if spec.checkpoint_claim:
        # Shared by every pod: each rank writes its shard, the driver commits.
        claim = {"claimName": spec.checkpoint_claim}
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": claim})
    return volumes
