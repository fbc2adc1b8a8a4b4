"""The environments a job's operator runs: for each, a Deployment, a ClusterIP Service,
a NetworkPolicy and, with several replicas, a PodDisruptionBudget, all named
`<job>-env-<name>` and owned by the job.

An environment executes the model's tool calls, so its pods get the least: restricted
Pod Security with a read-only root filesystem, no service-account token, no service
links, none of the job's own env or volumes, no egress unless `egress` or `egressTo`
asks (and never to the cluster's ranges or the metadata addresses), and ingress only
from the job's Ray pods. Pure, like children.py.
"""

from __future__ import annotations

from rlhf_operator.api.environments import EnvironmentSpec, service_name
from rlhf_operator.api.job import GROUP, RLHFJobSpec
from rlhf_operator.render.job_services import Egress
from rlhf_operator.render.meta import (
    JOB_LABEL,
    RAY_POD_COMPONENTS,
    JobRef,
    Obj,
    labels,
    metadata,
    pods_of,
)
from rlhf_operator.render.network import NetworkAccess, allowed_block, dns_rule
from rlhf_operator.render.pod import (
    container_resources,
    container_security,
    placement,
    pod_metadata,
    pod_security,
    pod_settings,
)

COMPONENT = "environment"  # not a Ray pod's: the job's own NetworkPolicy leaves them out
ENVIRONMENT_LABEL = f"{GROUP}/environment"  # the environment's name, on its pods
PORT_NAME = "env"
HEALTH_PATH = "/healthz"  # rlhf_env's server answers it once the class is loaded
LIVE_PATH = "/livez"  # rlhf_env's server: its loop answers and its threads run
# A read-only root filesystem, and Python or a library may still want a scratch place.
SCRATCH = {"name": "tmp", "mountPath": "/tmp"}
SCRATCH_SIZE = "256Mi"  # counts against the ephemeral storage limit below
EPHEMERAL_STORAGE = "512Mi"  # request and limit: logs and /tmp; an eviction names it


def render_environments(
    job: JobRef, spec: RLHFJobSpec, network: NetworkAccess | None = None
) -> list[Obj]:
    """Each operator-run environment's Deployment, Service, NetworkPolicy and disruption
    budget; nothing for one that runs at its url. `network`: the cluster's ranges and DNS
    (the chart's values; unset: their defaults)."""
    network = network or NetworkAccess()
    return [
        obj
        for env in spec.environments
        if env.operator_run
        for obj in (
            render_deployment(job, spec, env),
            render_service(job, env),
            render_environment_policy(job, env, network),
            *render_disruption_budget(job, env),
        )
    ]


def selector(job: JobRef, env: EnvironmentSpec) -> dict[str, str]:
    """The labels of exactly this environment's pods (job names are unique in a namespace)."""
    return {JOB_LABEL: job.name, ENVIRONMENT_LABEL: env.name}


def render_stopped_environments(job: JobRef, spec: RLHFJobSpec) -> list[Obj]:
    """The environments' Deployments once the job has ended, scaled to 0: their pods
    would only hold resources. The Services and policies stay until the job is deleted."""
    stopped = [render_deployment(job, spec, env) for env in spec.environments if env.operator_run]
    for deployment in stopped:
        deployment["spec"]["replicas"] = 0
    return stopped


def render_deployment(job: JobRef, spec: RLHFJobSpec, env: EnvironmentSpec) -> Obj:
    name = service_name(job.name, env.name)
    port = env.serving_port
    container: Obj = {
        "name": "environment",
        "image": env.image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": env.container_command(spec.multi_turn),
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        # Ready once the class is loaded and answers. Restarted (ending the sessions it
        # holds) when it has not been live for a minute: rlhf_env's /livez fails when
        # its event loop answers nothing, or calls past their deadline hold every thread
        # of its class; a command's own server is asked its /healthz.
        "readinessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": PORT_NAME},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {
                "path": LIVE_PATH if env.command is None else HEALTH_PATH,
                "port": PORT_NAME,
            },
            "periodSeconds": 10,
            "timeoutSeconds": 10,  # more than the server's own probe of its threads (5 s)
            "failureThreshold": 6,
        },
        "resources": container_resources(
            env.pod_resources(), {"ephemeral-storage": EPHEMERAL_STORAGE}
        ),
        "securityContext": {**container_security(), "readOnlyRootFilesystem": True},
        "volumeMounts": [SCRATCH],
    }
    if env.env:  # none of the job's pods.env: it may hold the trainer's secrets
        container["env"] = [e.to_dict() for e in env.env]
    pod: Obj = {
        "automountServiceAccountToken": False,  # it never talks to the API server
        "enableServiceLinks": False,  # no variables naming the namespace's other Services
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": [{"name": SCRATCH["name"], "emptyDir": {"sizeLimit": SCRATCH_SIZE}}],
        **pod_settings(spec),  # pull secrets and priority, as the job's other pods
        **placement(env.node_selector, env.tolerations, None),
    }
    if env.runtime_class_name is not None:  # a sandbox (gVisor, Kata) for the tool calls
        pod["runtimeClassName"] = env.runtime_class_name
    pod_labels = {**labels(job, COMPONENT), ENVIRONMENT_LABEL: env.name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(job, name, COMPONENT),
        "spec": {
            "replicas": env.replica_count,
            "selector": {"matchLabels": selector(job, env)},
            "template": {"metadata": pod_metadata(spec, pod_labels), "spec": pod},
        },
    }


def render_service(job: JobRef, env: EnvironmentSpec) -> Obj:
    """The name the trainer reaches the environment at (RLHFJobSpec.job_config).
    Headless: the name resolves to each ready replica's address, and the trainer picks
    the replica of each session (rlhf_env.replicas), since a session lives in one
    replica's memory and a proxy would balance its calls over all of them."""
    port = env.serving_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, service_name(job.name, env.name), COMPONENT),
        "spec": {
            "clusterIP": "None",
            "selector": selector(job, env),
            "ports": [
                {"name": PORT_NAME, "port": port, "targetPort": PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def render_environment_policy(job: JobRef, env: EnvironmentSpec, network: NetworkAccess) -> Obj:
    """Ingress from the job's Ray pods only, on the environment's port; egress what
    `environment_egress` gives. Always rendered: it needs no peers of the platform."""
    ray_pods = pods_of(job, RAY_POD_COMPONENTS)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, service_name(job.name, env.name), COMPONENT),
        "spec": {
            "podSelector": {"matchLabels": selector(job, env)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [{"podSelector": ray_pods}],
                    "ports": [{"protocol": "TCP", "port": env.serving_port}],
                }
            ],
            "egress": environment_egress(env, network),
        },
    }


def environment_egress(env: Egress, network: NetworkAccess) -> list[Obj]:
    """An environment's, or an agent's (render/agents.py). None by default. `egress:
    true`: every address but the cluster's ranges and the metadata addresses, so not the
    job's pods, the API server (its Service, and its endpoints where the ranges hold
    them) nor the node's credentials. `egressTo`: its
    CIDRs, on its ports. Either: DNS, to the cluster's DNS pods only."""
    rules: list[Obj] = []
    if env.egress:
        rules.append({"to": network.internet()})
    for rule in env.egress_to or []:
        # None: only metadata addresses of the chart's (the spec refuses the usual ones).
        if (block := allowed_block(rule.cidr, network.metadata)) is not None:
            ports = [{"protocol": "TCP", "port": p} for p in rule.ports or []]
            rules.append({"to": [block], **({"ports": ports} if ports else {})})
    if rules:
        rules.append(dns_rule(network.dns))
    return rules


def render_disruption_budget(job: JobRef, env: EnvironmentSpec) -> list[Obj]:
    """With several replicas, a drain takes one at a time: the sessions of one replica
    start again on the others (rlhf_env.replicas) while the rest serve. One replica has
    none: a drain must not wait on it. A budget left from more replicas is harmless."""
    if env.replica_count < 2:
        return []
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": metadata(job, service_name(job.name, env.name), COMPONENT),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(job, env)}},
        }
    ]
