"""A live attempt brought to the spec's mutable fields: the RayJob's suspend and the
replicas of the pools that resize in place (on the RayJob and on its running RayCluster),
and a queued job's Kueue Workload. Called by the reconciler (reconcile.py) on a job whose
RayJob exists."""

from __future__ import annotations

import logging

from kubernetes.client.exceptions import ApiException

from rlhf_operator.api.job import RLHFJobSpec
from rlhf_operator.controller.drift import replica_ops
from rlhf_operator.controller.kube import JSON_PATCH, Kube, Obj
from rlhf_operator.render.children import JobRef

log = logging.getLogger(__name__)

WORKLOAD_JOB_UID = "kueue.x-k8s.io/job-uid"  # Kueue's label: the uid of the Workload's job


def sync_rayjob(kube: Kube, ref: JobRef, spec: RLHFJobSpec, rayjob: Obj, desired: Obj) -> Obj:
    """Apply the spec's mutable fields: suspend (unless Kueue owns it), and the
    replicas of the pools that change size in place (resizes.py)."""
    ops = []
    suspend = rayjob["spec"].get("suspend", False)
    if spec.queue_name is None and suspend != desired["spec"]["suspend"]:
        ops.append({"op": "add", "path": "/spec/suspend", "value": desired["spec"]["suspend"]})
    live_groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    wanted_groups = [
        group
        for group in desired["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        if group["groupName"] in spec.elastic_pools  # the others: a new attempt
    ]
    ops += replica_ops(live_groups, wanted_groups, at="/spec/rayClusterSpec")
    if ops:
        log.info("updating RayJob %s/%s: %s", ref.namespace, ref.rayjob, ops)
        rayjob = kube.patch("RayJob", ref.namespace, ref.rayjob, ops, JSON_PATCH)
    _sync_cluster_replicas(kube, ref, rayjob, wanted_groups)
    return rayjob


def sync_workload(kube: Kube, spec: RLHFJobSpec, rayjob: Obj | None) -> Obj | None:
    """A queued job's Kueue Workload (None if Kueue has not made it). Kueue owns the
    RayJob's suspend: suspending the job deactivates the Workload, which Kueue then
    evicts; resuming activates it, and it queues again."""
    if spec.queue_name is None or rayjob is None:
        return None
    rayjob_meta = rayjob["metadata"]
    selector = f"{WORKLOAD_JOB_UID}={rayjob_meta['uid']}"
    try:
        found = kube.list("Workload", rayjob_meta["namespace"], selector)
    except ApiException as error:
        if error.status == 404:  # Kueue is not installed: the status says so
            return None
        raise
    if not found:
        return None
    workload = found[0]
    active = not spec.suspend
    if (workload.get("spec") or {}).get("active", True) != active:
        meta = workload["metadata"]
        workload = kube.patch(
            "Workload", meta["namespace"], meta["name"], {"spec": {"active": active}}
        )
    return workload


def _sync_cluster_replicas(kube: Kube, ref: JobRef, rayjob: Obj, wanted_groups: list[Obj]) -> None:
    """KubeRay does not push a RayJob's cluster spec to a running cluster, so scale
    the live RayCluster too (checked every time: the RayJob may have been patched by
    a reconcile that died before getting here). Not read when no pool resizes in
    place: there is nothing to scale."""
    name = (rayjob.get("status") or {}).get("rayClusterName")
    if not wanted_groups or not name:
        return
    cluster = kube.get("RayCluster", ref.namespace, name)
    if cluster is None:
        return
    ops = replica_ops(cluster["spec"]["workerGroupSpecs"], wanted_groups, at="/spec")
    if ops:
        kube.patch("RayCluster", ref.namespace, cluster["metadata"]["name"], ops, JSON_PATCH)
