"""Why a job's pods do not run, as Kubernetes says it on each pod: the scheduler's reason
for a pod it cannot place, and the kubelet's for each container: an image that cannot
be pulled, a container that cannot be created or keeps crashing, one that ended in
error. Pure: pods in, lines that say why out. PoolsReady and EnvironmentsReady both
say it this way."""

from __future__ import annotations

from typing import Any

# Waiting reasons of a container that is on its way: not a problem (yet).
STARTING = ("ContainerCreating", "PodInitializing")
MAX_MESSAGE = 300
MAX_LISTED = 3
# The reasons of a readiness condition (PoolsReady, EnvironmentsReady) while a pod cannot
# be placed (its message: the scheduler's words), and while a container cannot start or
# ends in error (the kubelet's).
UNSCHEDULABLE = "Unschedulable"
PODS_FAILING = "PodsFailing"


def pod_problems(pods: list[dict[str, Any]]) -> list[str]:
    """'pod P container C: Reason: message' for each failing container, at most
    MAX_LISTED (then how many more)."""
    found = [
        f"pod {pod['metadata'].get('name')} container {status.get('name')}: {problem}"
        for pod in pods
        if not terminating(pod)
        for status in _container_statuses(pod)
        if (problem := _container_problem(status))
    ]
    if len(found) > MAX_LISTED:
        return [*found[:MAX_LISTED], f"and {len(found) - MAX_LISTED} more"]
    return found


def unscheduled(pod: dict[str, Any]) -> str | None:
    """Why the scheduler has not placed the pod, as it said on it ('Unschedulable: 0/5
    nodes are available: ...'); None once placed, or while it is being deleted."""
    if terminating(pod):
        return None
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"{condition.get('reason') or 'NotScheduled'}: {short(condition.get('message'))}"
    return None


def terminating(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def short(message: Any) -> str:
    """A message on one line, at most MAX_MESSAGE characters."""
    return " ".join(str(message or "").split())[:MAX_MESSAGE]


def _container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _container_problem(status: dict[str, Any]) -> str | None:
    state = status.get("state") or {}
    waiting, ended = state.get("waiting"), state.get("terminated")
    if waiting and waiting.get("reason") not in (None, *STARTING):
        last = (status.get("lastState") or {}).get("terminated")
        before = f" (last exit: {_ended(last)})" if last else ""
        return f"{waiting['reason']}: {short(waiting.get('message'))}{before}".rstrip(": ")
    if ended and ended.get("exitCode", 0) != 0:
        return _ended(ended)
    return None


def _ended(terminated: dict[str, Any]) -> str:
    said = short(terminated.get("message"))
    what = f"{terminated.get('reason') or 'Error'}, exit code {terminated.get('exitCode')}"
    return f"{what}: {said}" if said else what
