"""The EnvironmentsReady condition: whether each environment the operator runs has all its
replicas ready, and if not, why, as the scheduler and the kubelet say it on its pods.
Pure: the spec, the environments' Deployments and the job's pods in, a verdict out.

A job whose environments all run at their `url` has no such condition: the operator
runs nothing for them, and the trainer checks them itself (it waits for each one's
/healthz before training, and fails naming it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_operator.api.environments import EnvironmentSpec
from rlhf_operator.api.job import RLHFJobSpec
from rlhf_operator.controller.pods import PODS_FAILING, UNSCHEDULABLE, pod_problems, unscheduled
from rlhf_operator.render.environments import COMPONENT, ENVIRONMENT_LABEL
from rlhf_operator.render.meta import COMPONENT_LABEL

CONDITION = "EnvironmentsReady"  # also its reason when True
STOPPED = "EnvironmentsStopped"  # its reason once the job has ended (scaled to 0)
# Its reason while a replica is merely on its way; while a pod cannot be placed, or a
# container cannot start or keeps failing: UNSCHEDULABLE, PODS_FAILING, as PoolsReady's.
NOT_READY = "EnvironmentsNotReady"


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
    """None when the job runs no environment. `deployments`: the live Deployments of its
    environments (a missing one is not ready); `pods`: the job's pods (any others are
    ignored); `ended`: the job has finished, and its environments are scaled to 0."""
    run = [env for env in spec.environments if env.operator_run]
    if not run:
        return None
    if ended:
        return Verdict(False, STOPPED, "the job has ended: its environments are scaled to 0")
    by_name = {_environment_of(d): d for d in deployments}
    waiting = [
        w for env in run if (w := _waiting(env, by_name.get(env.name), _pods_of(pods, env.name)))
    ]
    ready = f"{len(run) - len(waiting)}/{len(run)} environments have all their replicas ready"
    if not waiting:
        return Verdict(True, CONDITION, ready)
    reason = NOT_READY
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
    env: EnvironmentSpec, deployment: dict[str, Any] | None, pods: list[dict[str, Any]]
) -> _Waiting | None:
    """e.g. "environment lookup: 0 of 1 replicas ready, pod j-env-lookup-7d-x:
    Unschedulable: 0/5 nodes are available: ..."; None when it is ready."""
    want = env.replica_count
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
    line = ", ".join([f"environment {env.name}: {progress}", *placing[:1], *failing])
    return _Waiting(bool(placing), bool(failing), line)


def _environment_of(deployment: dict[str, Any]) -> str | None:
    """The environment a Deployment runs: its selector names it (render/environments.py)."""
    selector = (deployment.get("spec") or {}).get("selector") or {}
    name: str | None = (selector.get("matchLabels") or {}).get(ENVIRONMENT_LABEL)
    return name


def is_environment_pod(pod: dict[str, Any]) -> bool:
    """One of an environment's pods (render/environments.py), not one of the Ray job's."""
    return (pod["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == COMPONENT


def _pods_of(pods: list[dict[str, Any]], environment: str) -> list[dict[str, Any]]:
    return [
        p
        for p in pods
        if is_environment_pod(p)
        and (p["metadata"].get("labels") or {}).get(ENVIRONMENT_LABEL) == environment
    ]
