"""Why a job's pods do not run, as the kubelet says it on each container: an image that
cannot be pulled, a container that cannot be created or keeps crashing, one that ended
in error. Pure: pods in, one line per failing container out."""

from __future__ import annotations

from typing import Any

# Waiting reasons of a container that is on its way: not a problem (yet).
STARTING = ("ContainerCreating", "PodInitializing")
MAX_MESSAGE = 300
MAX_LISTED = 3


def pod_problems(pods: list[dict[str, Any]]) -> list[str]:
    """'pod P container C: Reason: message' for each failing container, at most
    MAX_LISTED (then how many more)."""
    found = [
        f"pod {pod['metadata'].get('name')} container {status.get('name')}: {problem}"
        for pod in pods
        if not pod["metadata"].get("deletionTimestamp")
        for status in _container_statuses(pod)
        if (problem := _container_problem(status))
    ]
    if len(found) > MAX_LISTED:
        return [*found[:MAX_LISTED], f"and {len(found) - MAX_LISTED} more"]
    return found


def _container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _container_problem(status: dict[str, Any]) -> str | None:
    state = status.get("state") or {}
    waiting, ended = state.get("waiting"), state.get("terminated")
    if waiting and waiting.get("reason") not in (None, *STARTING):
        last = (status.get("lastState") or {}).get("terminated")
        before = f" (last exit: {_ended(last)})" if last else ""
        return f"{waiting['reason']}: {_short(waiting.get('message'))}{before}".rstrip(": ")
    if ended and ended.get("exitCode", 0) != 0:
        return _ended(ended)
    return None


def _ended(terminated: dict[str, Any]) -> str:
    said = _short(terminated.get("message"))
    what = f"{terminated.get('reason') or 'Error'}, exit code {terminated.get('exitCode')}"
    return f"{what}: {said}" if said else what


def _short(message: Any) -> str:
    return " ".join(str(message or "").split())[:MAX_MESSAGE]
