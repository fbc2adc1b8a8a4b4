"""The agents a job's operator runs: for each, a Deployment, a headless Service, a
NetworkPolicy and, with several replicas, a PodDisruptionBudget, all named
`<job>-agent-<name>` and owned by the job; and one policy, `<job>-gateway`, that lets
them reach the rollout pool's gateway.

An agent runs its own loop (code the job's user brought) and calls the policy through
the OpenAI-compatible gateway each rollout engine serves in its Ray pod, on
GATEWAY_PORT. So its pods get what every job service gets (render/job_services.py), and
their policy admits the job's Ray pods (the trainer's POST /episodes) on the agent's
port, and lets them reach the rollout pool's pods on GATEWAY_PORT, the cluster's DNS,
and what `egress` allows: not the Ray head, nor any other port of the job's pods, nor
the API server. Pure, like children.py.
"""

from __future__ import annotations

from rlhf_operator.api.agents import AgentSpec, service_name
from rlhf_operator.api.job import GROUP, RLHFJobSpec
from rlhf_operator.render.environments import environment_egress
from rlhf_operator.render.job_services import (
    JobService,
    render_service_deployment,
    render_service_disruption_budget,
    render_service_policy,
    render_service_service,
)
from rlhf_operator.render.meta import (
    COMPONENT_LABEL,
    JOB_LABEL,
    RAY_POD_COMPONENTS,
    JobRef,
    Obj,
    metadata,
    pods_of,
)
from rlhf_operator.render.network import NetworkAccess, dns_rule
from rlhf_trainer.api.agents import GATEWAY_PORT
from rlhf_trainer.api.names import POOL_LABEL

COMPONENT = "agent"  # not a Ray pod's: the job's own NetworkPolicy leaves them out
AGENT_LABEL = f"{GROUP}/agent"  # the agent's name, on its pods
WORKER = "worker"  # the component of the pools' Ray pods (render/children.py)


def render_agents(
    job: JobRef, spec: RLHFJobSpec, network: NetworkAccess, isolated: bool
) -> list[Obj]:
    """Each operator-run agent's Deployment, Service, NetworkPolicy and disruption budget
    (nothing for one that runs at its url), and, where a policy of the job's own isolates
    its Ray pods (`isolated`), the gateway's policy that admits the agents."""
    run = [agent for agent in spec.agents if agent.operator_run]
    ray_pods = pods_of(job, RAY_POD_COMPONENTS)  # the trainer's POST /episodes
    objects: list[Obj] = []
    for agent in run:
        service = job_service(job, agent)
        objects += [
            render_service_deployment(spec, service),
            render_service_service(service),
            render_service_policy(service, ray_pods, agent_egress(job, spec, agent, network)),
            *render_service_disruption_budget(service),
        ]
    if run and isolated:
        objects.append(render_gateway_policy(job, spec))
    return objects


def render_stopped_agents(job: JobRef, spec: RLHFJobSpec) -> list[Obj]:
    """The agents' Deployments once the job has ended, scaled to 0: their pods would
    only hold resources. The Services and policies stay until the job is deleted."""
    stopped = [
        render_service_deployment(spec, job_service(job, agent))
        for agent in spec.agents
        if agent.operator_run
    ]
    for deployment in stopped:
        deployment["spec"]["replicas"] = 0
    return stopped


def job_service(job: JobRef, agent: AgentSpec) -> JobService:
    return JobService(
        job=job,
        name=agent.name,
        spec=agent,
        component=COMPONENT,
        name_label=AGENT_LABEL,
        object_name=service_name(job.name, agent.name),
        command=agent.container_command(),
    )


def rollout_pods(job: JobRef, spec: RLHFJobSpec) -> Obj:
    """The Ray pods of the job's rollout pool, where each engine serves its gateway."""
    return {
        "matchLabels": {
            JOB_LABEL: job.name,
            COMPONENT_LABEL: WORKER,
            POOL_LABEL: spec.roles.rollout,
        }
    }


def agent_pods(job: JobRef) -> Obj:
    """Every agent pod of the job."""
    return {"matchLabels": {JOB_LABEL: job.name, COMPONENT_LABEL: COMPONENT}}


def agent_egress(
    job: JobRef, spec: RLHFJobSpec, agent: AgentSpec, network: NetworkAccess
) -> list[Obj]:
    """The rollout pool's gateway and the cluster's DNS, and what egress and egressTo
    allow (as an environment's)."""
    gateway = {
        "to": [{"podSelector": rollout_pods(job, spec)}],
        "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}],
    }
    return [gateway, *(environment_egress(agent, network) or [dns_rule(network.dns)])]


def render_gateway_policy(job: JobRef, spec: RLHFJobSpec) -> Obj:
    """The rollout pool's pods admit the job's agents on GATEWAY_PORT. Policies add up:
    this opens that port to them and nothing else. Rendered only beside the job's own
    policy: alone, it would isolate the rollout pods from the rest of the job."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, f"{job.name}-gateway", "network"),
        "spec": {
            "podSelector": rollout_pods(job, spec),
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": agent_pods(job)}],
                    "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}],
                }
            ],
        },
    }
