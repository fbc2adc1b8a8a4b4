"""Status computation from observed state (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rlhf_operator.api.job import Phase, RLHFJobStatus
from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.heads import HEAD_ANNOTATION, observe_head, workers_of_a_lost_head
from rlhf_operator.controller.reconcile import status_patch
from rlhf_operator.controller.status import (
    Observed,
    compute_status,
    finished,
    invalid_status,
)
from rlhf_trainer.api.progress import TrainingProgress
from tests.unit.conftest import EXAMPLES, load

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPEC = parse_job(
    load(EXAMPLES[0].parent / "asymmetric-6-2.yaml")
).spec  # pools policy (6), value (2)


def pod(
    pool: str, node: str | None = "n1", ready: bool = True, terminating: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"rlhf.dev/pool": pool}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node} if node else {},
        "status": {
            "phase": "Running" if ready else "Pending",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def rayjob(deployment: str = "Running", job_status: str = "RUNNING") -> dict[str, Any]:
    return {
        "metadata": {"name": "asymmetric-6-2"},
        "status": {
            "jobDeploymentStatus": deployment,
            "jobStatus": job_status,
            "rayClusterName": "asymmetric-6-2-abcde",
        },
    }


def status(
    observed: Observed, old: RLHFJobStatus | None = None, now: datetime = T0
) -> RLHFJobStatus:
    return compute_status(SPEC, 3, observed, old or RLHFJobStatus(), now)


def test_no_rayjob_yet_is_pending_with_nothing_ready() -> None:
    s = status(Observed(None, []))
    assert s.phase is Phase.PENDING
    assert [(p.name, p.desired_gpus, p.ready_gpus) for p in s.pools] == [
        ("policy", 6, 0),
        ("value", 2, 0),
    ]
    assert s.pools_ready == "0/2"
    assert s.observed_generation == 3
    assert {c.type: c.status for c in s.conditions} == {
        "Invalid": "False",
        "PoolsReady": "False",
        "Ready": "False",
    }


def test_ready_pods_count_gpus_and_nodes_per_pool() -> None:
    pods = [
        pod("policy", "gpu-1"),
        pod("value", "gpu-2", ready=False),
        pod("value", None, ready=False),
    ]
    s = status(Observed(rayjob("Initializing", ""), pods))
    assert s.phase is Phase.PROVISIONING
    assert [(p.name, p.ready_gpus, p.nodes) for p in s.pools] == [
        ("policy", 6, ["gpu-1"]),
        ("value", 0, ["gpu-2"]),
    ]
    assert s.pools_ready == "1/2"
    assert s.ray_cluster == "asymmetric-6-2-abcde"


def unschedulable(pool: str, message: str) -> dict[str, Any]:
    pending = pod(pool, None, ready=False)
    pending["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    )
    return pending


def test_a_pool_the_scheduler_cannot_place_says_why_in_pools_ready() -> None:
    said = "0/5 nodes are available:\n 5 Insufficient nvidia.com/gpu."
    pods = [pod("policy"), unschedulable("value", said), unschedulable("value", "other")]
    pools_ready = next(
        c for c in status(Observed(rayjob(), pods)).conditions if c.type == "PoolsReady"
    )
    assert (pools_ready.status, pools_ready.reason) == ("False", "Unschedulable")
    assert pools_ready.message == (
        "1/2 pools have all their GPUs; pool value: 0/2 GPUs, "
        "Unschedulable: 0/5 nodes are available: 5 Insufficient nvidia.com/gpu."
    )


def test_pods_merely_starting_leave_pools_ready_without_a_scheduler_reason() -> None:
    pods = [pod("policy"), pod("value", "gpu-2", ready=False)]
    pools_ready = next(
        c for c in status(Observed(rayjob(), pods)).conditions if c.type == "PoolsReady"
    )
    assert (pools_ready.reason, pools_ready.message) == (
        "PoolsNotReady",
        "1/2 pools have all their GPUs",
    )


def test_terminating_pods_are_not_ready() -> None:
    s = status(Observed(rayjob(), [pod("policy", terminating=True), pod("value")]))
    assert s.pools[0].ready_gpus == 0


@pytest.mark.parametrize(("deployment", "job_status", "phase"), [
    ("", "", Phase.PROVISIONING), ("Initializing", "", Phase.PROVISIONING), ("Waiting", "", Phase.PROVISIONING),
    ("Running", "RUNNING", Phase.RUNNING), ("Complete", "SUCCEEDED", Phase.SUCCEEDED),
    ("Complete", "FAILED", Phase.FAILED), ("Complete", "STOPPED", Phase.FAILED), ("Failed", "", Phase.FAILED),
    ("Suspended", "", Phase.SUSPENDED), ("SomethingNew", "", Phase.PROVISIONING),
])  # fmt: skip
def test_kuberay_states_map_onto_phases(deployment: str, job_status: str, phase: Phase) -> None:
    assert status(Observed(rayjob(deployment, job_status), [])).phase is phase


def test_all_pools_ready_and_running_is_ready() -> None:
    s = status(Observed(rayjob(), [pod("policy"), pod("value")]))
    assert s.phase is Phase.RUNNING and s.pools_ready == "2/2" and s.start_time == T0
    assert {c.type: c.status for c in s.conditions} == {
        "Invalid": "False",
        "PoolsReady": "True",
        "Ready": "True",
    }


def test_a_finished_job_keeps_its_outcome_after_kuberay_cleans_up() -> None:
    done = status(Observed(rayjob("Complete", "SUCCEEDED"), []))
    assert finished(done) and done.completion_time == T0
    later = status(Observed(None, []), old=done, now=T0 + timedelta(hours=1))
    assert later.phase is Phase.SUCCEEDED and later.completion_time == T0


def test_unchanged_observation_gives_an_identical_status() -> None:
    # The reconciler writes only on change, so repeating must give the same status.
    observed = Observed(rayjob(), [pod("policy"), pod("value", ready=False)])
    first = status(observed)
    assert status(observed, old=first, now=T0 + timedelta(minutes=5)) == first


def test_condition_times_move_only_when_the_condition_flips() -> None:
    first = status(Observed(rayjob(), [pod("policy")]))
    later = status(
        Observed(rayjob(), [pod("policy"), pod("value")]), old=first, now=T0 + timedelta(minutes=1)
    )
    times = {c.type: c.last_transition_time for c in later.conditions}
    assert times["Invalid"] == T0 and times["PoolsReady"] == T0 + timedelta(minutes=1)
    assert [c.type for c in later.conditions] == [c.type for c in first.conditions]


def test_training_progress_is_carried_over() -> None:
    progress = TrainingProgress(step=7, total_steps=30, policy_version=7)
    s = status(Observed(rayjob(), []), old=RLHFJobStatus(training=progress))
    assert s.training == progress


def test_invalid_spec_fails_without_finishing() -> None:
    s = invalid_status(RLHFJobStatus(), 2, "spec.roles.actor: must name a pool", T0)
    assert s.phase is Phase.FAILED and not finished(s)
    invalid = next(c for c in s.conditions if c.type == "Invalid")
    assert (invalid.status, invalid.reason, invalid.message) == (
        "True",
        "InvalidSpec",
        "spec.roles.actor: must name a pool",
    )
    # once fixed, the job proceeds: the Invalid condition clears and the phase follows KubeRay
    fixed = status(Observed(None, []), old=s)
    assert fixed.phase is Phase.PENDING
    assert next(c for c in fixed.conditions if c.type == "Invalid").status == "False"


QUEUED_SPEC = SPEC.model_copy(update={"queue_name": "team"})


def workload(reason: str, message: str) -> dict[str, Any]:
    condition = {"type": "QuotaReserved", "status": "False", "reason": reason, "message": message}
    return {"metadata": {"name": "rayjob-x"}, "status": {"conditions": [condition]}}


def queued_status(
    suspended: bool, found: dict[str, Any] | None, spec: Any = QUEUED_SPEC
) -> RLHFJobStatus:
    job = rayjob("Suspended" if suspended else "Running") | {"spec": {"suspend": suspended}}
    return compute_status(spec, 3, Observed(job, [], found), RLHFJobStatus(), T0)


def test_a_job_kueue_has_not_admitted_is_queued_with_kueues_reason() -> None:
    said = (
        "couldn't assign flavors to pod set critic:\n insufficient unused quota for nvidia.com/gpu"
    )
    s = queued_status(True, workload("Pending", said))
    assert s.phase is Phase.QUEUED
    conditions = {c.type: c for c in s.conditions}
    expected = f"queued in LocalQueue team: Pending: {' '.join(said.split())}"
    assert (conditions["Ready"].reason, conditions["Ready"].message) == ("Queued", expected)
    assert conditions["PoolsReady"].reason == "Queued"
    assert conditions["PoolsReady"].message == f"0/2 pools have all their GPUs; {expected}"


def test_a_queued_job_without_a_workload_says_kueue_has_not_made_one() -> None:
    ready = next(c for c in queued_status(True, None).conditions if c.type == "Ready")
    assert "no Kueue Workload yet" in ready.message


def test_an_admitted_job_follows_kuberay_and_a_suspended_one_is_suspended() -> None:
    assert queued_status(False, workload("QuotaReserved", "")).phase is Phase.RUNNING
    suspended = QUEUED_SPEC.model_copy(update={"suspend": True})
    assert queued_status(True, None, suspended).phase is Phase.SUSPENDED
    # Without a queue, a suspended RayJob is the user's suspension, not a queue.
    assert queued_status(True, None, SPEC).phase is Phase.SUSPENDED


def test_the_cluster_kuberay_names_for_a_suspended_rayjob_is_not_reported() -> None:
    """KubeRay names the cluster as it initialises a suspended RayJob, and clears the name
    once Suspended: no such cluster is made. Once the RayJob runs, its cluster is named;
    suspended again, the status keeps the last cluster that ran."""
    initializing = rayjob("Initializing", "NEW") | {"spec": {"suspend": True}}
    assert status(Observed(initializing, [])).ray_cluster is None
    running = status(Observed(rayjob() | {"spec": {"suspend": False}}, []))
    assert running.ray_cluster == "asymmetric-6-2-abcde"
    suspending = rayjob("Suspending", "RUNNING") | {"spec": {"suspend": True}}
    assert status(Observed(suspending, []), running).ray_cluster == "asymmetric-6-2-abcde"


def with_container(
    pool: str | None, name: str, state: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    failing = pod(pool or "", ready=False)
    if pool is None:  # the head or the submitter: no pool label
        failing["metadata"]["labels"] = {}
    failing["metadata"]["name"] = name
    failing["status"]["containerStatuses"] = [{"name": "ray", "state": state, **extra}]
    return failing


def test_a_pod_that_cannot_start_says_why_by_pod_and_container() -> None:
    pull = {"waiting": {"reason": "ErrImagePull", "message": 'pull "rlhf-trainer:9": not found'}}
    crash = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}
    last = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    pods = [
        pod("policy"),
        with_container(None, "job-head-x", pull),
        with_container("value", "job-value-y", crash, lastState=last),
        with_container("value", "job-value-z", {"waiting": {"reason": "ContainerCreating"}}),
    ]
    pools_ready = next(
        c
        for c in status(Observed(rayjob("Initializing"), pods)).conditions
        if c.type == "PoolsReady"
    )
    assert (pools_ready.status, pools_ready.reason) == ("False", "PodsFailing")
    assert pools_ready.message == (
        "1/2 pools have all their GPUs; "
        'pod job-head-x container ray: ErrImagePull: pull "rlhf-trainer:9": not found; '
        "pod job-value-y container ray: CrashLoopBackOff: back-off 10s "
        "(last exit: OOMKilled, exit code 137)"
    )


def test_a_container_that_ended_in_error_is_named_and_one_that_succeeded_is_not() -> None:
    failed = {"terminated": {"reason": "Error", "exitCode": 1, "message": "Traceback ..."}}
    done = {"terminated": {"reason": "Completed", "exitCode": 0}}
    pods = [pod("policy"), pod("value"), with_container(None, "submitter", done)]
    assert (
        next(
            c for c in status(Observed(rayjob(), pods)).conditions if c.type == "PoolsReady"
        ).reason
        == "PoolsReady"
    )
    pods.append(with_container(None, "worker", failed))
    message = next(
        c for c in status(Observed(rayjob(), pods)).conditions if c.type == "PoolsReady"
    ).message
    assert message.endswith("pod worker container ray: Error, exit code 1: Traceback ...")


def head(
    name: str,
    cluster: str = "asymmetric-6-2-abcde",
    terminating: bool = False,
    made: str = "2026-01-01T00:00:00Z",
    node_type: str = "head",
    uid: str | None = None,
) -> Any:
    """A Ray pod as KubeRay labels it: a head, or a worker."""
    ray_pod = pod("head" if node_type == "head" else "policy", terminating=terminating)
    ray_pod["metadata"] |= {"name": name, "creationTimestamp": made, "uid": uid or f"u-{name}"}
    ray_pod["metadata"]["labels"] |= {"ray.io/node-type": node_type, "ray.io/cluster": cluster}
    return ray_pod


HEAD = "asymmetric-6-2-abcde-head"  # KubeRay's deterministic head name: the same each time


def reconciled(
    job: dict[str, Any], pods: list[dict[str, Any]], old: RLHFJobStatus, now: datetime = T0
) -> RLHFJobStatus:
    """What the reconciler does with the head: record it on the RayJob (`job`, changed
    in place as the API server would), then compute the status."""
    view = observe_head(job, pods, old, now)
    if view.record is not None:
        job["metadata"].setdefault("annotations", {})[HEAD_ANNOTATION] = view.record
    return compute_status(SPEC, 3, Observed(job, pods, head=view), old, now)


def test_a_head_made_again_under_its_name_is_a_driver_restart_told_by_its_uid() -> None:
    """KubeRay makes a lost head again under the same name: its uid tells. A head going
    away is not yet one; a status write lost after the record, or a repeated reconcile,
    counts it once; a new attempt's cluster is not one."""
    job = rayjob()
    first = reconciled(job, [head(HEAD, uid="u1")], RLHFJobStatus())
    assert (first.ray_head, first.driver_restarts) == (HEAD, 0)
    going = reconciled(job, [head(HEAD, terminating=True, uid="u1")], first)
    gone = reconciled(job, [], going)
    assert (gone.ray_head, gone.driver_restarts) == (HEAD, 0)
    again = reconciled(job, [head(HEAD, uid="u2")], gone)
    assert (again.ray_head, again.driver_restarts) == (HEAD, 1)
    assert reconciled(job, [head(HEAD, uid="u2")], again) == again
    # The status patch lost after the record was written: the next reconcile counts it.
    assert reconciled(job, [head(HEAD, uid="u2")], gone).driver_restarts == 1
    next_attempt = rayjob()
    next_attempt["status"]["rayClusterName"] = "asymmetric-6-2-fghij"
    other = reconciled(next_attempt, [head("h-3", "asymmetric-6-2-fghij")], again)
    assert (other.ray_cluster, other.ray_head, other.driver_restarts) == (
        "asymmetric-6-2-fghij", "h-3", 1
    )  # fmt: skip
    another_clusters_head = reconciled(job, [head("h-9", "someone-else")], again)
    assert another_clusters_head.ray_head == HEAD


def test_a_new_attempt_does_not_take_the_last_attempts_head_for_its_own() -> None:
    """A resize or a restart: the new RayJob names no cluster yet while the last
    attempt's head, its cluster still in the status, is alive or going. It is not the
    new attempt's head: nothing is recorded on the new RayJob, and the new attempt's
    head, when it comes, is its first (no driver restart, no lost head)."""
    job = rayjob()
    before = reconciled(job, [head(HEAD, uid="u1")], RLHFJobStatus())
    new = rayjob()
    new["metadata"]["uid"] = "attempt-2"
    del new["status"]["rayClusterName"]
    waiting = reconciled(new, [head(HEAD, uid="u1")], before)
    assert HEAD_ANNOTATION not in new["metadata"].get("annotations", {})
    new["status"]["rayClusterName"] = "asymmetric-6-2-fghij"
    started = reconciled(new, [head(HEAD, terminating=True, uid="u1"),
                               head("h-2", "asymmetric-6-2-fghij", uid="u2")], waiting)  # fmt: skip
    assert (started.ray_head, started.driver_restarts) == ("h-2", 0)
    assert started.last_failure is None


def lost(**status: Any) -> Any:
    """The head u1 as the kubelet or the API server leaves it when it is lost."""
    terminating = status.pop("terminating", False)
    found = head(HEAD, uid="u1", terminating=terminating)
    found["status"] |= status
    return found


OOM = {"phase": "Failed", "containerStatuses": [{"name": "ray-head", "state": {"terminated": {
    "reason": "OOMKilled", "exitCode": 137}}}]}  # fmt: skip
EVICTED = {"phase": "Failed", "reason": "Evicted",
           "message": "The node was low on resource: memory."}  # fmt: skip
NODE_LOST = {"terminating": True, "conditions": [{"type": "DisruptionTarget", "status": "True",
             "reason": "DeletionByTaintManager"}]}  # fmt: skip


@pytest.mark.parametrize(
    ("state", "reason", "said"),
    [(OOM, "OOMKilled", ""), (EVICTED, "Evicted", ": The node was low on resource: memory."),
     (NODE_LOST, "NodeLost", ""), ({"terminating": True}, "Deleted", "")],
    ids=["OOMKilled", "evicted", "node lost", "deleted"],
)  # fmt: skip
def test_a_lost_head_is_the_last_failure_with_its_pods_reason(
    state: dict[str, Any], reason: str, said: str
) -> None:
    job = rayjob()
    job["metadata"]["uid"] = "attempt-1"
    running = reconciled(job, [head(HEAD, uid="u1")], RLHFJobStatus())
    failing = reconciled(job, [lost(**dict(state))], running, T0 + timedelta(seconds=5))
    failure = failing.last_failure
    assert failure is not None and (failure.reason, failure.ray_job_uid) == (reason, "attempt-1")
    assert failure.message == f"the Ray head pod {HEAD} (uid u1) was lost{said}"
    # Seen again later, and once the new head is up: the same failure, first seen at +5 s.
    later = T0 + timedelta(seconds=9)
    assert reconciled(job, [lost(**dict(state))], failing, later).last_failure == failure
    replaced = reconciled(job, [head(HEAD, uid="u2")], failing, later)
    assert (replaced.last_failure, replaced.driver_restarts) == (failure, 1)


def test_a_head_gone_before_its_reason_was_seen_is_still_the_last_failure() -> None:
    job = rayjob()
    running = reconciled(job, [head(HEAD, uid="u1")], RLHFJobStatus())
    replaced = reconciled(job, [head(HEAD, uid="u2")], running)
    failure = replaced.last_failure
    assert failure is not None and failure.reason == "RayHeadLost" and "u1" in failure.message
    assert replaced.driver_restarts == 1


@pytest.mark.parametrize("deployment", ["Complete", "Failed", "Suspending"])
def test_a_head_torn_down_after_the_attempt_is_not_a_lost_head(deployment: str) -> None:
    job = rayjob()
    running = reconciled(job, [head(HEAD, uid="u1")], RLHFJobStatus())
    job["status"]["jobDeploymentStatus"] = deployment
    assert reconciled(job, [lost(terminating=True)], running).last_failure is None
    job["status"]["jobDeploymentStatus"] = "Running"  # the control: while it runs, it is
    assert reconciled(job, [lost(terminating=True)], running).last_failure is not None


def merge_patch(target: Any, patch: Any) -> Any:
    """What the API server makes of `target` given a merge patch (RFC 7386)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def test_a_new_attempts_head_is_not_a_driver_restart_once_the_status_is_written() -> None:
    """Between two attempts the job names the new cluster and has no head yet: the status
    patch must clear the last attempt's head. Left out of the patch, it stayed, and the
    new attempt's head, in the same cluster as far as the status said, counted as a
    driver restart (an event, and the new attempt's workers deleted)."""
    first = status(Observed(rayjob(), [head("h-1")]))
    next_attempt = rayjob()
    next_attempt["status"]["rayClusterName"] = "asymmetric-6-2-fghij"
    between = status(Observed(next_attempt, [head("h-1", terminating=True)]), first)
    assert (between.ray_cluster, between.ray_head) == ("asymmetric-6-2-fghij", None)

    stored = merge_patch(first.to_dict(), status_patch(first, between))
    read_back = RLHFJobStatus.model_validate(stored)
    assert read_back == between
    then = status(Observed(next_attempt, [head("h-3", "asymmetric-6-2-fghij")]), read_back)
    assert (then.ray_head, then.driver_restarts) == ("h-3", 0)
    assert status_patch(between, between) is None


def test_the_status_patch_leaves_the_trainers_progress_alone() -> None:
    progress = TrainingProgress(step=3, total_steps=10)
    old = RLHFJobStatus(phase=Phase.RUNNING, training=progress)
    new = RLHFJobStatus(phase=Phase.SUCCEEDED)
    patch = status_patch(old, new)
    assert patch is not None and "training" not in patch and patch["phase"] == "Succeeded"
    assert status_patch(old, old.model_copy(update={"training": None})) is None


def test_the_workers_of_a_lost_head_are_those_of_its_cluster_made_before_the_new_head() -> None:
    def worker(name: str, made: str, **more: Any) -> Any:
        return head(name, made=made, node_type="worker", **more)

    pods = [
        head("h-2", made="2026-01-01T00:10:00Z"),
        worker("w-old", "2026-01-01T00:01:00Z"),
        worker("w-going", "2026-01-01T00:01:00Z", terminating=True),
        worker("w-new", "2026-01-01T00:10:05Z"),
        worker("w-elsewhere", "2026-01-01T00:01:00Z", cluster="someone-else"),
    ]
    lost = workers_of_a_lost_head(pods, "asymmetric-6-2-abcde", "h-2")
    assert [p["metadata"]["name"] for p in lost] == ["w-old"]
    assert workers_of_a_lost_head(pods, "asymmetric-6-2-abcde", "h-gone") == []
    assert workers_of_a_lost_head(pods, None, "h-2") == []
