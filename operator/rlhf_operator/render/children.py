"""Pure rendering: an RLHFJob's spec -> the Kubernetes objects it owns.

No API calls here; the reconciler decides what to create or patch. Every child has a
name derived from the job's, the job's labels and an owner reference, so the garbage
collector removes it with the job and a re-render always names the same objects.
"""

from __future__ import annotations

from rlhf_operator.api.job import (
    GROUP,
    PLURAL,
    Device,
    RLHFJobSpec,
    Separation,
)
from rlhf_operator.api.podspec import PodResources
from rlhf_operator.api.pools import Pool
from rlhf_operator.render.agents import AGENT_LABEL, render_agents
from rlhf_operator.render.environments import ENVIRONMENT_LABEL, render_environments
from rlhf_operator.render.meta import JOB_LABEL as JOB_LABEL  # re-exported
from rlhf_operator.render.meta import (
    JOB_POD_COMPONENTS,
    Obj,
    labels,
    metadata,
    pods_of,
)
from rlhf_operator.render.meta import JobRef as JobRef
from rlhf_operator.render.network import (
    RAY_DASHBOARD_PORT,
    RAY_METRICS_PORT,
    NetworkAccess,
    render_environment_guard,
    render_network_policy,
)
from rlhf_operator.render.pod import (
    SPEC_MOUNT,
    container_resources,
    container_security,
    mounts,
    placement,
    pod_metadata,
    pod_security,
    pod_settings,
    ray_environment,
    volumes,
)
from rlhf_trainer.api.names import POOL_LABEL, pool_resource

RAY_VERSION = "2.60.0"  # the Ray in the trainer image (a test keeps it equal to the pin)
SPEC_FILE = "spec.json"
# The driver runs in the head pod (KubeRay submits the entrypoint there) and serves
# the trainer's metrics on this port.
TRAINER_METRICS_PORT = 9400
# KubeRay adds its default head ports only to a container that declares none, and finds
# the dashboard (where it submits the job) by its port's name: without "dashboard" the
# RayJob never leaves Initializing. "metrics" is Ray's own, as KubeRay's monitors expect.
HEAD_PORTS = {
    "gcs-server": 6379,
    "dashboard": RAY_DASHBOARD_PORT,
    "client": 10001,
    "metrics": RAY_METRICS_PORT,
    "trainer-metrics": TRAINER_METRICS_PORT,
}
ENTRYPOINT = (
    f"python -m rlhf_trainer --spec {SPEC_MOUNT}/{SPEC_FILE} --metrics-port {TRAINER_METRICS_PORT}"
)

SCHEDULER_LABEL = "ray.io/scheduler-name"  # KubeRay: the batch scheduler of the pods
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue: the LocalQueue that admits the RayJob
HEAD_DEFAULTS = PodResources(cpu=2, memory="8Gi")
# `ray job submit`, then following the driver's log: little, so a small node fits a job.
SUBMITTER_RESOURCES = PodResources(cpu="200m", memory="512Mi")
SUBMITTER_RETRIES = 2  # KubeRay's default backoffLimit of the submitter, made explicit


def render_children(
    job: JobRef, spec: RLHFJobSpec, network: NetworkAccess | None = None
) -> list[Obj]:
    """Every object the job owns, in creation order (the RayJob's dependencies first, the
    RayJob last); `network`: the chart's values (unset: the defaults)."""
    network = network or NetworkAccess()
    job_policy = render_job_policy(job, spec, network)
    return [
        render_spec_configmap(job, spec),
        *render_reporter_rbac(job),
        *job_policy,
        *render_environments(job, spec, network),
        *render_agents(job, spec, network, isolated=bool(job_policy)),
        render_rayjob(job, spec),
    ]


def render_job_policy(job: JobRef, spec: RLHFJobSpec, network: NetworkAccess) -> list[Obj]:
    """With the chart's peers, a policy that admits only what the job needs. Without
    them, where an environment or agent may open connections, one that admits all but
    the environments' and agents' pods. Else none: an environment without egress reaches
    nothing, an agent only the gateway."""
    meta = metadata(job, job.name, "network")
    # By component, not the job label alone: the environments' and agents' pods carry
    # that too, and they run the model's tool calls or the user's agent; they must not
    # reach the Ray head (its job API runs any code).
    job_pods = pods_of(job, JOB_POD_COMPONENTS)
    if network.peers is not None:
        return [render_network_policy(meta, job_pods, network.peers, TRAINER_METRICS_PORT)]
    if any(e.opens_connections for e in spec.environments) or any(
        a.opens_connections for a in spec.agents
    ):
        services = (ENVIRONMENT_LABEL, AGENT_LABEL)
        return [render_environment_guard(meta, job_pods, services, network.cluster_ranges)]
    return []


def render_spec_configmap(job: JobRef, spec: RLHFJobSpec) -> Obj:
    """The validated trainer-facing spec, mounted into every Ray pod."""
    config = spec.job_config(job.name).model_dump_json(by_alias=True, exclude_none=True, indent=1)
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
    meta = metadata(job, job.rayjob, "rayjob")
    if spec.scheduler_name is not None:
        # KubeRay copies a RayJob's labels to its RayCluster, whose label picks the
        # batch scheduler of the cluster's pods.
        meta["labels"][SCHEDULER_LABEL] = spec.scheduler_name
    if spec.queue_name is not None:
        meta["labels"][QUEUE_LABEL] = spec.queue_name
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": meta,
        "spec": {
            "entrypoint": ENTRYPOINT,
            # Kueue admits a queued job by resuming it (and suspends it to evict it).
            "suspend": spec.suspend or spec.queue_name is not None,
            # Free the GPUs as soon as training ends; status stays on the RLHFJob.
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 60,
            "backoffLimit": 0,  # the trainer resumes from checkpoints; no blind resubmits
            # A lost head fails the submitter's pod; its retry follows the new head's
            # driver. Said here, so that status can say when they run out.
            "submitterConfig": {"backoffLimit": SUBMITTER_RETRIES},
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
        "securityContext": pod_security(),
        "containers": [
            {
                "name": "ray-head",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                **ray_environment(job.name, spec),
                "ports": [
                    {"name": name, "containerPort": port, "protocol": "TCP"}
                    for name, port in HEAD_PORTS.items()
                ],
                "resources": container_resources(
                    (head.resources or PodResources()).filled(HEAD_DEFAULTS)
                ),
                "securityContext": container_security(),
                "volumeMounts": mounts(spec),
            }
        ],
        "volumes": volumes(job.spec_configmap, spec, head.shm_size),
        **pod_settings(spec),
        **placement(head.node_selector, head.tolerations, None),
    }
    return {
        # No Ray work on the head: it runs the driver; GPU work goes to the pools.
        "rayStartParams": {"num-cpus": "0"},
        "template": {
            # The annotations for Prometheus' pod discovery (the chart's PodMonitor
            # selects the labels).
            "metadata": pod_metadata(
                spec,
                labels(job, "head"),
                {"prometheus.io/scrape": "true", "prometheus.io/port": str(TRAINER_METRICS_PORT)},
            ),
            "spec": pod,
        },
    }


def _worker_group(job: JobRef, spec: RLHFJobSpec, pool: Pool) -> Obj:
    pod_labels = {**labels(job, "worker"), POOL_LABEL: pool.name}
    gpus = str(pool.gpus_per_node)
    extra = dict(pool.extra_resources or {})
    if pool.device is Device.GPU:
        extra[pool.gpu_resource] = gpus
    pod: Obj = {
        "automountServiceAccountToken": False,  # workers never talk to the API server
        "securityContext": pod_security(),
        "containers": [
            {
                "name": "ray-worker",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                **ray_environment(job.name, spec),
                "resources": container_resources(pool.pod_resources(), extra),
                "securityContext": container_security(),
                "volumeMounts": mounts(spec),
            }
        ],
        "volumes": volumes(job.spec_configmap, spec, pool.shm_size),
        **pod_settings(spec),
        **placement(pool.node_selector, pool.tolerations, _pool_affinity(job, spec, pool)),
    }
    return {
        "groupName": pool.name,
        "replicas": pool.replicas,
        "minReplicas": pool.replicas,
        "maxReplicas": pool.replicas,
        "numOfHosts": 1,
        "rayStartParams": {},
        # Ray sees the pool's GPUs (logical ones on a CPU pool) and a resource named
        # after the pool, so the trainer places each role's workers onto its pool.
        "resources": {"GPU": gpus, pool_resource(pool.name): gpus},
        "labels": {POOL_LABEL: pool.name},
        "template": {"metadata": pod_metadata(spec, pod_labels), "spec": pod},
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


def _submitter_template(job: JobRef, spec: RLHFJobSpec) -> Obj:
    # KubeRay fills in the `ray job submit` command; we set who it runs as.
    return {
        "metadata": pod_metadata(spec, labels(job, "submitter")),
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": pod_security(),
            "containers": [
                {
                    "name": "ray-job-submitter",
                    "image": spec.image,
                    "imagePullPolicy": spec.image_pull_policy,
                    "resources": container_resources(SUBMITTER_RESOURCES),
                    "securityContext": container_security(),
                }
            ],
            **pod_settings(spec),
            **placement(spec.head.node_selector, spec.head.tolerations, None),
        },
    }
