"""The environments a job's operator runs: for each, a Deployment, a headless Service, a
NetworkPolicy and, with several replicas, a PodDisruptionBudget, all named
`<job>-env-<name>` and owned by the job (render/job_services.py renders them, as an
agent's).

An environment executes the model's tool calls, so its pods get the least: restricted
Pod Security with a read-only root filesystem, no service-account token, no service
links, none of the job's own env or volumes, no egress unless `egress` or `egressTo`
asks (and never to the cluster's ranges or the metadata addresses), and ingress only
from the job's Ray pods. Pure, like children.py.
"""

from __future__ import annotations

from rlhf_operator.api.environments import EnvironmentSpec, service_name
from rlhf_operator.api.job import GROUP, RLHFJobSpec
from rlhf_operator.render.job_services import (
    HEALTH_PATH,
    Egress,
    JobService,
    render_service_deployment,
    render_service_disruption_budget,
    render_service_policy,
    render_service_service,
)
from rlhf_operator.render.meta import RAY_POD_COMPONENTS, JobRef, Obj, pods_of
from rlhf_operator.render.network import NetworkAccess, allowed_block, dns_rule

COMPONENT = "environment"  # not a Ray pod's: the job's own NetworkPolicy leaves them out
ENVIRONMENT_LABEL = f"{GROUP}/environment"  # the environment's name, on its pods
PORT_NAME = "env"
LIVE_PATH = "/livez"  # rlhf_env's server: its loop answers and its threads run


def render_environments(
    job: JobRef, spec: RLHFJobSpec, network: NetworkAccess | None = None
) -> list[Obj]:
    """Each operator-run environment's Deployment, Service, NetworkPolicy and disruption
    budget; nothing for one that runs at its url. `network`: the cluster's ranges and DNS
    (the chart's values; unset: their defaults). The NetworkPolicy admits the job's Ray
    pods only, on the environment's port, and lets it reach what `environment_egress`
    gives: it needs no peers of the platform, so it is always rendered."""
    network = network or NetworkAccess()
    ray_pods = pods_of(job, RAY_POD_COMPONENTS)
    objects: list[Obj] = []
    for env in spec.environments:
        if env.operator_run:
            service = environment_service(job, spec, env)
            objects += [
                render_service_deployment(spec, service),
                render_service_service(service),
                render_service_policy(service, ray_pods, environment_egress(env, network)),
                *render_service_disruption_budget(service),
            ]
    return objects


def render_stopped_environments(job: JobRef, spec: RLHFJobSpec) -> list[Obj]:
    """The environments' Deployments once the job has ended, scaled to 0: their pods
    would only hold resources. The Services and policies stay until the job is deleted."""
    stopped = [
        render_service_deployment(spec, environment_service(job, spec, env))
        for env in spec.environments
        if env.operator_run
    ]
    for deployment in stopped:
        deployment["spec"]["replicas"] = 0
    return stopped


def environment_service(job: JobRef, spec: RLHFJobSpec, env: EnvironmentSpec) -> JobService:
    """The environment as render/job_services.py renders it. The trainer reaches it at
    its headless Service (RLHFJobSpec.job_config) and keeps each session on the replica
    that started it. Restarted (ending the sessions it holds) when it has not been live
    for a minute: rlhf_env's /livez fails when its event loop answers nothing, or calls
    past their deadline hold every thread of its class; a command's own server is asked
    its /healthz."""
    return JobService(
        job=job,
        name=env.name,
        spec=env,
        component=COMPONENT,
        name_label=ENVIRONMENT_LABEL,
        object_name=service_name(job.name, env.name),
        command=env.container_command(spec.multi_turn),
        live_path=LIVE_PATH if env.command is None else HEALTH_PATH,
        port_name=PORT_NAME,
    )


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
