"""Pure status computation: what the operator observed -> the RLHFJob's status.

The reconciler is the only writer of these fields; `training` belongs to the trainer
and is carried over untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rlhf_operator.api.job import (
    AttemptFailure,
    Condition,
    Phase,
    PoolStatus,
    RLHFJobSpec,
    RLHFJobStatus,
)
from rlhf_operator.controller.environments import (
    AGENTS,
    ENVIRONMENTS,
    agents_ready,
    environments_ready,
    is_service_pod,
)
from rlhf_operator.controller.heads import HeadView, observe_head
from rlhf_operator.controller.pods import (
    PODS_FAILING,
    UNSCHEDULABLE,
    pod_problems,
    short,
    terminating,
    unscheduled,
)
from rlhf_operator.controller.resizes import ResizeAction, ResizeDecision
from rlhf_operator.controller.restarts import FIRST_LINE, Action, Decision
from rlhf_trainer.api.names import POOL_LABEL
from rlhf_trainer.api.progress import TrainingProgress

TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)
# PoolsReady's reasons: pods.UNSCHEDULABLE while the scheduler cannot place a pool's pod,
# pods.PODS_FAILING while a container cannot start or ends in error, and this while
# Kueue has not admitted the job (its message: Kueue's reason).
QUEUED = "Queued"
# Ready's reason while the installed KubeRay cannot run the job (nothing is created).
KUBERAY_INCOMPATIBLE = "KubeRayIncompatible"
# Conditions whose (type, reason) is news the user must see: each new message is an Event.
WARNING_CONDITIONS = {
    ("PoolsReady", UNSCHEDULABLE),
    ("PoolsReady", PODS_FAILING),
    *((k.condition, why) for k in (ENVIRONMENTS, AGENTS) for why in (UNSCHEDULABLE, PODS_FAILING)),
    ("Ready", KUBERAY_INCOMPATIBLE),
}

# KubeRay's RayJob.status.jobDeploymentStatus -> our phase (Complete is resolved by
# jobStatus; anything not listed, e.g. a new KubeRay state, reads as Provisioning).
_DEPLOYMENT_PHASE = {
    "Running": Phase.RUNNING,
    "Failed": Phase.FAILED,
    "ValidationFailed": Phase.FAILED,
    "Suspending": Phase.SUSPENDED,
    "Suspended": Phase.SUSPENDED,
}


@dataclass(frozen=True)
class Observed:
    """What the reconciler saw of the job's children."""

    rayjob: dict[str, Any] | None
    pods: list[dict[str, Any]]  # all the job's: head, pools, submitter, environments, agents
    workload: dict[str, Any] | None = None  # Kueue's, for a queued job (spec.queueName)
    # The Deployments of the environments and agents the operator runs.
    deployments: list[dict[str, Any]] = field(default_factory=list)
    # The attempt's Ray head as the reconciler recorded it (heads.py); None: from the above.
    head: HeadView | None = None


def finished(status: RLHFJobStatus) -> bool:
    """The job ran to an end (an invalid spec is Failed too, but not finished: fix it)."""
    return status.phase in TERMINAL and status.completion_time is not None


def invalid_status(
    old: RLHFJobStatus, generation: int | None, message: str, now: datetime
) -> RLHFJobStatus:
    conditions = _set_condition(
        old.conditions, "Invalid", True, "InvalidSpec", message, now, generation
    )
    conditions = _set_condition(
        conditions, "Ready", False, "InvalidSpec", "the spec is invalid", now, generation
    )
    return old.model_copy(
        update={"phase": Phase.FAILED, "observed_generation": generation, "conditions": conditions}
    )


def blocked_status(
    old: RLHFJobStatus, generation: int | None, reason: str, message: str, now: datetime
) -> RLHFJobStatus:
    """A valid job that cannot start, and waits (Pending) for what `message` names."""
    conditions = _set_condition(old.conditions, "Ready", False, reason, message, now, generation)
    return old.model_copy(
        update={"phase": Phase.PENDING, "observed_generation": generation, "conditions": conditions}
    )


def warnings(status: RLHFJobStatus) -> dict[tuple[str, str], str]:
    """(type, reason) -> message of the conditions in WARNING_CONDITIONS."""
    return {
        (c.type, c.reason): c.message
        for c in status.conditions
        if (c.type, c.reason) in WARNING_CONDITIONS
    }


def compute_status(
    spec: RLHFJobSpec,
    generation: int | None,
    observed: Observed,
    old: RLHFJobStatus,
    now: datetime,
    restart: Decision | None = None,
    resize: ResizeDecision | None = None,
) -> RLHFJobStatus:
    """`restart`: what the reconciler decided about a failed attempt (restarts.decide);
    `resize`: about an attempt whose pools changed size (resizes.decide_resize)."""
    pools = [_pool_status(spec, pool.name, observed.pods) for pool in spec.pools]
    restarting = restart is not None and restart.action is not Action.NONE
    resizing = resize is not None and resize.action is not ResizeAction.NONE
    if finished(old):  # a finished job keeps its outcome, even once its RayJob is gone
        phase = old.phase
    elif restarting:
        phase = Phase.RESTARTING
    else:
        phase = Phase.RESIZING if resizing else _phase(spec, observed.rayjob)
    rayjob_status = (observed.rayjob or {}).get("status") or {}
    # KubeRay names a suspended RayJob's cluster while it initialises it, then clears the
    # name: that cluster is never made, and the status does not say it (nor is patched
    # once more, in a burst of queued or suspended jobs, to say it).
    suspended = ((observed.rayjob or {}).get("spec") or {}).get("suspend", False)
    cluster = (None if suspended else rayjob_status.get("rayClusterName")) or old.ray_cluster
    head = observed.head or observe_head(observed.rayjob, observed.pods, old, now)
    failure = restart.failure if restart and restart.failure else head.failure
    recorded = restart is not None and restart.action is Action.RECORD

    if phase is Phase.QUEUED:
        ready_message = _queued(spec, observed.workload)
    else:
        ready_message = _phase_message(phase, failure, old.training)
    if resize is not None and resizing:
        ready_message = _resize_message(resize)
    # The environments' and agents' readiness says why they wait; the phase follows the
    # RayJob alone (the trainer waits for each one's /healthz, and fails naming it).
    services = [
        (kind.condition, verdict)
        for kind, ready in ((ENVIRONMENTS, environments_ready), (AGENTS, agents_ready))
        if (verdict := ready(spec, observed.deployments, observed.pods, finished(old)))
    ]
    conditions = old.conditions
    for kind, ok, reason, message in (
        ("Invalid", False, "Valid", "the spec is valid"),
        ("PoolsReady", *_pools_ready(spec, pools, observed, phase)),
        *((name, v.ok, v.reason, v.message) for name, v in services),
        ("Ready", phase is Phase.RUNNING, phase.value, ready_message),
    ):  # fmt: skip
        conditions = _set_condition(conditions, kind, ok, reason, message, now, generation)

    return RLHFJobStatus(
        phase=phase,
        observed_generation=generation,
        conditions=conditions,
        pools=pools,
        pools_ready=_ready_fraction(pools),
        training=old.training,
        ray_job=(observed.rayjob or {}).get("metadata", {}).get("name", old.ray_job),
        ray_cluster=cluster,
        start_time=old.start_time or (now if phase is Phase.RUNNING else None),
        completion_time=old.completion_time or (now if phase in TERMINAL else None),
        restarts=old.restarts + recorded,
        ray_head=head.name,
        driver_restarts=head.driver_restarts,
        last_failure=failure,
        resizing=list(resize.resizes) if resize is not None and resizing else None,
    )


def _pools_ready(
    spec: RLHFJobSpec, pools: list[PoolStatus], observed: Observed, phase: Phase
) -> tuple[bool, str, str]:
    """PoolsReady: whether every pool has all its GPUs, its reason, its message."""
    unplaced = [w for pool in pools if (w := _unscheduled(pool, observed.pods))]
    # The Ray job's pods; the environments' and agents' have conditions of their own.
    failing = pod_problems([p for p in observed.pods if not is_service_pod(p)])
    queued = [_queued(spec, observed.workload)] if phase is Phase.QUEUED else []
    all_ready = all(p.ready_gpus == p.desired_gpus for p in pools)
    reason = "PoolsReady" if all_ready else "PoolsNotReady"
    if failing and phase not in TERMINAL:
        reason = PODS_FAILING
    if unplaced or queued:
        reason = QUEUED if queued else UNSCHEDULABLE
    message = "; ".join(
        [f"{_ready_fraction(pools)} pools have all their GPUs", *unplaced, *queued, *failing]
    )
    return all_ready, reason, message


def _ready_fraction(pools: list[PoolStatus]) -> str:
    """Pools with all their GPUs / pools, e.g. '1/2'."""
    return f"{sum(p.ready_gpus == p.desired_gpus for p in pools)}/{len(pools)}"


def _resize_message(resize: ResizeDecision) -> str:
    """e.g. "the job is resizing pool policy from 1 to 2 nodes: the trainer checkpoints
    at the end of its step, and the next attempt resumes there on the new sizes"."""
    pools = ", ".join(
        f"pool {r.pool} from {r.from_replicas} to {r.to_replicas} nodes" for r in resize.resizes
    )
    what = f"the job is resizing {pools}" if pools else "the job is starting its next attempt"
    if resize.action is ResizeAction.WAIT:
        return (
            f"{what}: the trainer checkpoints at the end of its step, and the next attempt "
            "resumes there on the new sizes"
        )
    return f"{what}: the next attempt starts on the new sizes (from the last checkpoint, if any)"


def reported_to_the_end(training: TrainingProgress | None) -> bool:
    """Whether the trainer's reports reached its last step. A driver exits 0 only at the
    end, or when asked to stop (resizes.stopped_early): a Succeeded job without it lost
    its reports (a refused PATCH, a default-deny egress), and says so in a Warning."""
    return training is not None and training.step >= training.total_steps


def _phase_message(
    phase: Phase, failure: AttemptFailure | None, training: TrainingProgress | None
) -> str:
    if failure is not None and phase in (Phase.FAILED, Phase.RESTARTING):
        # The trainer's own word when it said why (a rank out of memory, say), else
        # KubeRay's first line; the driver's logs stay in lastFailure.
        said = training.failure if training and training.failure else failure.message
        said = said.split("\n", 1)[0][:FIRST_LINE]
        what = f"{failure.reason}: {said}" if said else failure.reason
        return f"the job is {phase.value.lower()} after its attempt failed ({what})"
    if phase is Phase.SUCCEEDED and not reported_to_the_end(training):
        last = f"step {training.step} of {training.total_steps}" if training else "none"
        return (
            f"the job is succeeded: its driver exited 0, but the trainer's last report is "
            f"{last}; its progress reports did not reach the job's status (RBAC, network?)"
        )
    if phase is Phase.SUCCEEDED and training is not None and training.output is not None:
        output = training.output
        what = "a LoRA adapter (peft)" if output.adapter else "a Hugging Face directory"
        return (
            f"the job is succeeded: the trained policy (step {output.step}) is at "
            f"{output.path}, {what} in {output.dtype}"
        )
    return f"the job is {phase.value.lower()}"


def _phase(spec: RLHFJobSpec, rayjob: dict[str, Any] | None) -> Phase:
    if rayjob is None:
        return Phase.PENDING
    status = rayjob.get("status") or {}
    deployment = status.get("jobDeploymentStatus", "")
    if deployment == "Complete":
        return Phase.SUCCEEDED if status.get("jobStatus") == "SUCCEEDED" else Phase.FAILED
    if spec.suspend:
        return Phase.SUSPENDED
    if spec.queue_name is not None and (rayjob.get("spec") or {}).get("suspend"):
        return Phase.QUEUED  # Kueue resumes the RayJob when it admits it
    return _DEPLOYMENT_PHASE.get(deployment, Phase.PROVISIONING)


def _queued(spec: RLHFJobSpec, workload: dict[str, Any] | None) -> str:
    """Why Kueue has not admitted the job, as Kueue says it on the job's Workload:
    "queued in LocalQueue team: Pending: couldn't assign flavors to pod set ..."."""
    where = f"queued in LocalQueue {spec.queue_name}"
    if workload is None:
        return f"{where}: no Kueue Workload yet (is Kueue running, with its RayJob integration?)"
    conditions = (workload.get("status") or {}).get("conditions") or []
    reserved = next((c for c in conditions if c.get("type") == "QuotaReserved"), None)
    if reserved is None or reserved.get("status") == "True" or not reserved.get("message"):
        return f"{where}: waiting for Kueue"
    said = short(reserved["message"])
    return f"{where}: {reserved.get('reason') or 'Pending'}: {said}"


def _pool_status(spec: RLHFJobSpec, pool_name: str, pods: list[dict[str, Any]]) -> PoolStatus:
    pool = next(p for p in spec.pools if p.name == pool_name)
    mine = _of_pool(pods, pool_name)
    ready = sum(_is_ready(p) for p in mine)
    nodes = sorted({p["spec"]["nodeName"] for p in mine if p.get("spec", {}).get("nodeName")})
    return PoolStatus(
        name=pool_name,
        desired_gpus=pool.total_gpus,
        ready_gpus=min(ready, pool.replicas) * pool.gpus_per_node,
        nodes=nodes,
    )


def _unscheduled(pool: PoolStatus, pods: list[dict[str, Any]]) -> str | None:
    """Why the scheduler has not placed one of the pool's pods, as it said on the pod:
    "pool rollout: 0/8 GPUs, Unschedulable: 0/5 nodes are available: ..."."""
    for pod in _of_pool(pods, pool.name):
        if why := unscheduled(pod):
            return f"pool {pool.name}: {pool.ready_gpus}/{pool.desired_gpus} GPUs, {why}"
    return None


def _of_pool(pods: list[dict[str, Any]], pool_name: str) -> list[dict[str, Any]]:
    return [p for p in pods if (p["metadata"].get("labels") or {}).get(POOL_LABEL) == pool_name]


def _is_ready(pod: dict[str, Any]) -> bool:
    if terminating(pod):
        return False
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _set_condition(
    conditions: list[Condition],
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """Replace one condition; its transition time moves only when its status flips."""
    value = "True" if ok else "False"
    previous = next((c for c in conditions if c.type == kind), None)
    since = previous.last_transition_time if previous and previous.status == value else now
    updated = Condition(
        type=kind,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    if previous is None:
        return [*conditions, updated]
    return [updated if c.type == kind else c for c in conditions]
