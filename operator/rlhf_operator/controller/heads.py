"""The Ray head of an attempt, told by its pod's uid: KubeRay (>= 1.4) may give head pods
deterministic names, so a head lost and made again keeps its name.

Which head an attempt is on, and the job's driver restarts counted with it, are
recorded on the attempt itself (the RayJob's HEAD_ANNOTATION), before the status says
so: a reconcile repeated after a status write that failed, or run by another replica,
finds the new head recorded and counts it once. The status (rayHead, driverRestarts)
mirrors the record. A head seen lost (its pod failed or going) is the job's lastFailure,
with the pod's reason: OOMKilled, Evicted, NodeLost, Preempted, Deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rlhf_operator.api.job import AttemptFailure, RLHFJobStatus
from rlhf_operator.controller.pods import terminating

# KubeRay's labels of a Ray cluster's pods: which cluster, and head or worker.
RAY_CLUSTER_LABEL, RAY_NODE_TYPE_LABEL = "ray.io/cluster", "ray.io/node-type"
HEAD_ANNOTATION = "rlhf.dev/ray-head"  # {"uid": the head pod's, "driverRestarts": n}
LOST_UNSEEN = "RayHeadLost"  # lastFailure's reason for a head gone before its reason was seen
# A pod's DisruptionTarget reason -> what lastFailure says.
DISRUPTIONS = {
    "DeletionByTaintManager": "NodeLost",  # its node unreachable (NoExecute taint)
    "PreemptionByScheduler": "Preempted",
    "EvictionByEvictionAPI": "Evicted",
    "TerminationByKubelet": "Evicted",  # node pressure or a graceful node shutdown
}

Obj = dict[str, Any]


@dataclass(frozen=True)
class HeadView:
    """What the status says of the attempt's head, and what the reconciler records."""

    name: str | None  # the live head pod's name (the last one's while none is live)
    driver_restarts: int
    failure: AttemptFailure | None  # the job's lastFailure
    record: str | None = None  # HEAD_ANNOTATION's new value, if it changes


def observe_head(
    rayjob: Obj | None, pods: list[Obj], old: RLHFJobStatus, now: datetime
) -> HeadView:
    """The head of the attempt's Ray cluster (the one the RayJob names), against the
    RayJob's record. Only the RayJob's own: a new attempt's RayJob names none at first,
    while the last attempt's cluster, still in the status, is torn down; its head taken
    for the new attempt's would be recorded on it, and the new head then counted lost."""
    cluster = ((rayjob or {}).get("status") or {}).get("rayClusterName")
    same_cluster = cluster is not None and cluster == old.ray_cluster
    recorded = _recorded(rayjob)
    count = max(old.driver_restarts, recorded[1] if recorded else 0)
    heads = _heads(pods, cluster)
    live = next((pod for pod in heads if loss_reason(pod) is None), None)
    failure = old.last_failure
    lost = next((p for p in heads if recorded and p["metadata"].get("uid") == recorded[0]
                 and loss_reason(p) is not None), None)  # fmt: skip
    if lost is not None and _running(rayjob):  # not a cluster torn down at the end
        failure = _kept(failure, head_failure(lost, rayjob, now))
    if live is None:
        return HeadView(old.ray_head if same_cluster else None, count, failure)
    uid, record = live["metadata"]["uid"], None
    if recorded is None:
        record = _record(uid, count)
    elif recorded[0] != uid:  # KubeRay made another head for the same cluster
        count += 1
        record = _record(uid, count)
        if failure is None or recorded[0] not in failure.message:
            failure = AttemptFailure(
                reason=LOST_UNSEEN, time=now, ray_job_uid=_uid(rayjob),
                message=f"the Ray head pod (uid {recorded[0]}) was lost; it was gone "
                f"before the operator saw why",
            )  # fmt: skip
    return HeadView(live["metadata"]["name"], count, failure, record)


def loss_reason(pod: Obj) -> str | None:
    """Why a pod is lost (failed, or going), None while it is not."""
    status = pod.get("status") or {}
    if status.get("phase") != "Failed" and not terminating(pod):
        return None
    for container in status.get("containerStatuses") or []:
        if (container.get("state", {}).get("terminated") or {}).get("reason") == "OOMKilled":
            return "OOMKilled"
    if status.get("reason"):  # the kubelet's: Evicted, NodeLost, Shutdown, ...
        return str(status["reason"])
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            reason = str(condition.get("reason") or "Disrupted")
            return DISRUPTIONS.get(reason, reason)
    return "Deleted" if terminating(pod) else "Failed"


def head_failure(pod: Obj, rayjob: Obj | None, now: datetime) -> AttemptFailure:
    """lastFailure for a lost head pod: its reason, and the kubelet's words."""
    meta, status = pod["metadata"], pod.get("status") or {}
    said = [status.get("message")] + [
        (c.get("state", {}).get("terminated") or {}).get("message")
        for c in status.get("containerStatuses") or []
    ]
    detail = "; ".join(s for s in said if s)
    return AttemptFailure(
        reason=loss_reason(pod) or LOST_UNSEEN,
        message=f"the Ray head pod {meta['name']} (uid {meta.get('uid')}) was lost"
        + (f": {detail}" if detail else ""),
        time=now,
        ray_job_uid=_uid(rayjob),
    )


def workers_of_a_lost_head(pods: list[Obj], cluster: str | None, head: str | None) -> list[Obj]:
    """The worker pods of Ray cluster `cluster` made before its live head pod `head`: they
    joined the head that was lost. Without GCS fault tolerance the new head does not take
    them back: their containers exit and restart until it is up, in a crash loop whose
    backoff grows to minutes. New pods wait for the new head (KubeRay's init container)."""
    live = [p for p in _heads(pods, cluster) if p["metadata"]["name"] == head]
    if cluster is None or not live or loss_reason(live[0]) is not None:
        return []
    made = live[0]["metadata"].get("creationTimestamp", "")
    return [
        pod
        for pod in pods
        if (labels := pod["metadata"].get("labels") or {}).get(RAY_NODE_TYPE_LABEL) == "worker"
        and labels.get(RAY_CLUSTER_LABEL) == cluster
        and not terminating(pod)
        and pod["metadata"].get("creationTimestamp", "") < made  # RFC 3339, UTC
    ]


def record_patch(record: str) -> Obj:
    return {"metadata": {"annotations": {HEAD_ANNOTATION: record}}}


def _heads(pods: list[Obj], cluster: str | None) -> list[Obj]:
    return [
        pod
        for pod in pods
        if (labels := pod["metadata"].get("labels") or {}).get(RAY_NODE_TYPE_LABEL) == "head"
        and cluster is not None
        and labels.get(RAY_CLUSTER_LABEL) == cluster
    ]


def _recorded(rayjob: Obj | None) -> tuple[str, int] | None:
    raw = ((rayjob or {}).get("metadata", {}).get("annotations") or {}).get(HEAD_ANNOTATION)
    try:
        record = json.loads(raw) if raw else None
        return (str(record["uid"]), int(record["driverRestarts"])) if record else None
    except (ValueError, KeyError, TypeError):  # edited by hand: recorded anew
        return None


def _record(uid: str, count: int) -> str:
    return json.dumps({"uid": uid, "driverRestarts": count}, separators=(",", ":"))


def _kept(old: AttemptFailure | None, new: AttemptFailure) -> AttemptFailure:
    """The failure already recorded, if it says the same (its time is when first seen)."""
    return old if old is not None and old.message == new.message else new


def _running(rayjob: Obj | None) -> bool:
    """Whether the attempt runs: KubeRay tears its cluster down after, or for a suspend,
    and the garbage collector once the RayJob is deleted (a restart, a resize)."""
    if rayjob is None or "deletionTimestamp" in rayjob["metadata"]:
        return False
    return bool((rayjob.get("status") or {}).get("jobDeploymentStatus") == "Running")


def _uid(rayjob: Obj | None) -> str:
    return str((rayjob or {}).get("metadata", {}).get("uid", ""))
