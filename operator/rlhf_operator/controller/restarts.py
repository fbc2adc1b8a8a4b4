"""Pure restart decisions: a failed attempt (RayJob) -> what the reconciler does next.

An attempt is one RayJob, told apart from the next by its uid. When it fails and the
job has restarts left, the reconciler records the failure in status (counting the
restart there, once per uid, so a reconcile repeated or resumed by a new operator
counts it once), waits out the backoff, deletes the failed RayJob, and creates the next
one, which resumes from the newest checkpoint on the job's claim.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeGuard

from rlhf_operator.api.job import AttemptFailure, Phase, RestartPolicy, RLHFJobStatus
from rlhf_operator.render.children import SUBMITTER_RETRIES

FAILED_DEPLOYMENTS = ("Failed", "ValidationFailed")  # KubeRay's jobDeploymentStatus
# KubeRay's reason when it first reconciles a RayJob over 30 s after its submitter ended
# (DefaultSubmitterFinishedTimeout, rayjob_controller.go): it marks the attempt Failed
# without asking the head how the Ray job ended. On a loaded control plane a driver that
# exited 0 (the end, or a stop for a resize) so became a failed attempt, and a restart.
LATE_VERDICT = "JobDeploymentStatusTransitionGracePeriodExceeded"
# The Ray job's terminal statuses (the head's job API) -> KubeRay's jobDeploymentStatus.
RAY_JOB_ENDED = {"SUCCEEDED": "Complete", "STOPPED": "Complete", "FAILED": "Failed"}
MAX_FAILURE_MESSAGE = 1024  # of an attempt's failure, kept in status.lastFailure
# KubeRay's words when the submitter's Kubernetes Job ran out of retries: each Ray head
# lost in an attempt fails the submitter's pod once (render.children.SUBMITTER_RETRIES).
SUBMITTER_GAVE_UP = ("SubmissionFailed", "BackoffLimitExceeded")
SUBMITTER_RETRIES_EXHAUSTED = "SubmitterRetriesExhausted"
FIRST_LINE = 300  # of it, in the Ready condition and the Restarting event


class Action(StrEnum):
    NONE = "none"  # running, finished, or failed for good
    RECORD = "record"  # count this failure as a restart, in status
    WAIT = "wait"  # counted; the backoff is not over
    DELETE = "delete"  # counted and waited: delete the failed RayJob


@dataclass(frozen=True)
class Decision:
    action: Action
    failure: AttemptFailure | None = None  # the failed attempt, if the RayJob failed
    wait_seconds: float = 0.0


def attempt_failure(rayjob: dict[str, Any] | None, now: datetime) -> AttemptFailure | None:
    """The RayJob's failure as KubeRay reports it; None unless it failed."""
    status = (rayjob or {}).get("status") or {}
    deployment = status.get("jobDeploymentStatus", "")
    failed = deployment in FAILED_DEPLOYMENTS or (
        deployment == "Complete" and status.get("jobStatus") == "FAILED"
    )
    if rayjob is None or not failed:
        return None
    reason, message = status.get("reason") or deployment, status.get("message") or ""
    if reason == SUBMITTER_GAVE_UP[0] and SUBMITTER_GAVE_UP[1] in message:
        reason, message = SUBMITTER_RETRIES_EXHAUSTED, submitter_gave_up(message)
    return AttemptFailure(
        reason=reason,
        message=head_and_tail(message),
        time=now,
        ray_job_uid=rayjob["metadata"]["uid"],
    )


def submitter_gave_up(kuberays: str) -> str:
    """Why an attempt failed whose submitter ran out of retries, said as it happened."""
    return (
        f"the Ray head was lost {SUBMITTER_RETRIES + 1} times in this attempt: each loss "
        f"fails the pod that runs `ray job submit`, and KubeRay gives up after "
        f"{SUBMITTER_RETRIES} retries (a new attempt resumes from the last checkpoint "
        f"if restartPolicy allows). KubeRay: {kuberays}"
    )


def late_verdict(rayjob: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    status = (rayjob or {}).get("status") or {}
    return (status.get("jobDeploymentStatus"), status.get("reason")) == ("Failed", LATE_VERDICT)


def head_job_url(rayjob: dict[str, Any]) -> str | None:
    """Where the attempt's head answers about its Ray job (Ray's job API, what KubeRay
    itself asks), None if KubeRay has not said."""
    status = rayjob.get("status") or {}
    url, job_id = status.get("dashboardURL"), status.get("jobId")
    return f"http://{url}/api/jobs/{job_id}" if url and job_id else None


def as_the_ray_job_ended(rayjob: dict[str, Any], ray_job: dict[str, Any] | None) -> dict[str, Any]:
    """`rayjob` (a `late_verdict`) as KubeRay writes it when it asks the head in time:
    `ray_job` is the head's answer about the Ray job (None: none could be had). The
    submitter's exit says nothing: a retried submitter (a lost head) runs `ray job logs
    --follow`, which exits 0 however the job ended, and `ray job submit` exits 0 on
    STOPPED. Without a terminal answer, KubeRay's Failed stands."""
    state = (ray_job or {}).get("status")
    if state not in RAY_JOB_ENDED:
        return rayjob
    ended = {
        "jobDeploymentStatus": RAY_JOB_ENDED[state],
        "jobStatus": state,
        "reason": "AppFailed" if state == "FAILED" else "",
        "message": str((ray_job or {}).get("message") or ""),
    }
    return rayjob | {"status": rayjob["status"] | ended}


def counted(old: RLHFJobStatus, rayjob: dict[str, Any]) -> bool:
    """Whether the attempt's failure is counted already (a restart under way)."""
    failure = old.last_failure
    uid = rayjob["metadata"].get("uid")
    return old.phase is Phase.RESTARTING and failure is not None and failure.ray_job_uid == uid


def head_and_tail(text: str, limit: int = MAX_FAILURE_MESSAGE) -> str:
    """KubeRay's message carries up to 20,000 characters of the driver's last logs: keep
    its first line (what failed) and the end of the logs (the error), `limit` in all."""
    if len(text) <= limit:
        return text
    first = text.split("\n", 1)[0][:FIRST_LINE]
    return f"{first}\n...\n{text[len(text) - (limit - len(first) - 5) :]}"


def decide(
    policy: RestartPolicy, rayjob: dict[str, Any] | None, old: RLHFJobStatus, now: datetime
) -> Decision:
    failure = attempt_failure(rayjob, now)
    if failure is None:
        return Decision(Action.NONE)
    counted = old.last_failure
    # Counted already (a repeated reconcile, or a new operator): go on, never count twice.
    if old.phase is Phase.RESTARTING and counted and counted.ray_job_uid == failure.ray_job_uid:
        waited = (now - counted.time).total_seconds() if counted.time else policy.backoff_seconds
        left = policy.backoff_seconds - waited
        return (
            Decision(Action.WAIT, counted, left) if left > 0 else Decision(Action.DELETE, counted)
        )
    if old.restarts < policy.max_restarts:
        return Decision(Action.RECORD, failure, float(policy.backoff_seconds))
    return Decision(Action.NONE, failure)
