"""The EnvironmentsReady and AgentsReady conditions: whether each environment (agent)
the operator runs has all its replicas ready, and if not, why, as the scheduler and the
kubelet say it on its pods. Pure: the spec, the Deployments and the job's pods in, a
verdict out. One implementation, parameterised by the kind of service (`Services`).

A job whose environments (agents) all run at their `url` has no such condition: the
operator runs nothing for them, and the trainer checks them itself (it waits for each
one's /healthz before training, and fails naming it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_operator.api.job import RLHFJobSpec
from rlhf_operator.controller.pods import PODS_FAILING, UNSCHEDULABLE, pod_problems, unscheduled
from rlhf_operator.render import agents, environments
from rlhf_operator.render.meta import COMPONENT_LABEL


@dataclass(frozen=True)
class Services:
    """A kind of service the operator runs for a job, as its condition names it."""

    plural: str  # "environments"
    component: str  # its pods' app.kubernetes.io/component
    name_label: str  # each one's name, on its Deployment's selector and its pods

    @property
    def one(self) -> str:
        return self.plural.removesuffix("s")

    @property
    def condition(self) -> str:  # also its reason when True
        return f"{self.plural.capitalize()}Ready"

    @property
    def stopped(self) -> str:  # its reason once the job has ended (scaled to 0)
        return f"{self.plural.capitalize()}Stopped"

    @property
    def not_ready(self) -> str:
        """Its reason while a replica is merely on its way; while a pod cannot be placed,
        or a container cannot start or keeps failing: UNSCHEDULABLE, PODS_FAILING, as
        PoolsReady's."""
        return f"{self.plural.capitalize()}NotReady"


ENVIRONMENTS = Services("environments", environments.COMPONENT, environments.ENVIRONMENT_LABEL)
AGENTS = Services("agents", agents.COMPONENT, agents.AGENT_LABEL)
CONDITION = ENVIRONMENTS.condition  # EnvironmentsReady
STOPPED = ENVIRONMENTS.stopped
NOT_READY = ENVIRONMENTS.not_ready


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    message: str


@dataclass(frozen=True)
class _Waiting:
    """One environment that is not ready: how far along, and what its pods say."""

    unschedulable: bool
    failing: bool
    line: str


def environments_ready(
    spec: RLHFJobSpec,
    deployments: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    ended: bool = False,
) -> Verdict | None:
    """EnvironmentsReady (`services_ready`); None when the job runs no environment."""
    run = {e.name: e.replica_count for e in spec.environments if e.operator_run}
    return services_ready(ENVIRONMENTS, run, deployments, pods, ended)


def agents_ready(
    spec: RLHFJobSpec,
    deployments: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    ended: bool = False,
) -> Verdict | None:
    """AgentsReady (`services_ready`); None when the job runs no agent."""
    run = {a.name: a.replica_count for a in spec.agents if a.operator_run}
    return services_ready(AGENTS, run, deployments, pods, ended)


def services_ready(
    kind: Services,
    run: dict[str, int],
    deployments: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    ended: bool = False,
) -> Verdict | None:
    """None when the job runs none of this kind. `run`: the replicas of each one the
    operator runs, by name; `deployments`: the job's live Deployments (a missing one is
    not ready); `pods`: the job's pods (any others are ignored); `ended`: the job has
    finished, and they are scaled to 0."""
    if not run:
        return None
    if ended:
        return Verdict(False, kind.stopped, f"the job has ended: its {kind.plural} are scaled to 0")
    by_name = {_name_of(d, kind): d for d in deployments}
    waiting = [
        w
        for name, replicas in run.items()
        if (w := _waiting(kind, name, replicas, by_name.get(name), _pods_of(pods, kind, name)))
    ]
    ready = f"{len(run) - len(waiting)}/{len(run)} {kind.plural} have all their replicas ready"
    if not waiting:
        return Verdict(True, kind.condition, ready)
    reason = kind.not_ready
    if any(w.failing for w in waiting):
        reason = PODS_FAILING
    if any(w.unschedulable for w in waiting):
        reason = UNSCHEDULABLE
    return Verdict(False, reason, "; ".join([ready, *(w.line for w in waiting)]))


def deployment_ready(deployment: dict[str, Any] | None, replicas: int) -> bool:
    """Whether the Deployment runs `replicas` ready pods of its current template, and
    nothing else: its controller has seen its latest spec, and no old pod is left."""
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    seen: bool = status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    updated: int = status.get("updatedReplicas", 0)
    ready: int = status.get("readyReplicas", 0)
    return (
        seen and ready >= replicas and updated >= replicas and status.get("replicas", 0) <= updated
    )


def _waiting(
    kind: Services,
    name: str,
    want: int,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
) -> _Waiting | None:
    """e.g. "environment lookup: 0 of 1 replicas ready, pod j-env-lookup-7d-x:
    Unschedulable: 0/5 nodes are available: ..."; None when it is ready."""
    if deployment_ready(deployment, want):
        return None
    ready = min(((deployment or {}).get("status") or {}).get("readyReplicas", 0), want)
    progress = f"{ready} of {want} replicas ready"
    if deployment is None:
        progress += " (no Deployment yet)"
    elif ready == want:  # the old pods are; the new template's are on their way
        progress += ", rolling out a change"
    placing = [f"pod {p['metadata'].get('name')}: {why}" for p in pods if (why := unscheduled(p))]
    failing = pod_problems(pods)
    line = ", ".join([f"{kind.one} {name}: {progress}", *placing[:1], *failing])
    return _Waiting(bool(placing), bool(failing), line)


def _name_of(deployment: dict[str, Any], kind: Services) -> str | None:
    """The environment (agent) a Deployment runs: its selector names it."""
    selector = (deployment.get("spec") or {}).get("selector") or {}
    name: str | None = (selector.get("matchLabels") or {}).get(kind.name_label)
    return name


def is_service_pod(pod: dict[str, Any]) -> bool:
    """One of an environment's or an agent's pods, not one of the Ray job's."""
    return _component(pod) in (ENVIRONMENTS.component, AGENTS.component)


def _component(pod: dict[str, Any]) -> str | None:
    component: str | None = (pod["metadata"].get("labels") or {}).get(COMPONENT_LABEL)
    return component


def _pods_of(pods: list[dict[str, Any]], kind: Services, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in pods
        if _component(p) == kind.component
        and (p["metadata"].get("labels") or {}).get(kind.name_label) == name
    ]
