"""Restart decisions and the status they lead to, attempt after attempt (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rlhf_operator.api.job import Phase, RestartPolicy, RLHFJobStatus
from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.resizes import STOP_ASKED, ResizeAction, decide_resize
from rlhf_operator.controller.restarts import (
    LATE_VERDICT,
    Action,
    as_the_ray_job_ended,
    attempt_failure,
    counted,
    decide,
    head_job_url,
    late_verdict,
)
from rlhf_operator.controller.status import Observed, compute_status, finished
from rlhf_operator.render.children import JobRef, render_rayjob
from tests.unit.conftest import EXAMPLES, load

T0 = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = RestartPolicy(max_restarts=2, backoff_seconds=30)
SPEC = parse_job(load(EXAMPLES[0].parent / "colocated.yaml")).spec.model_copy(
    update={"restart_policy": POLICY, "checkpoint_claim": "ckpt"}
)


def attempt(uid: str, deployment: str = "Running", **status: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "colocated", "uid": uid},
        "status": {"jobDeploymentStatus": deployment, **status},
    }


def failed(uid: str) -> dict[str, Any]:
    return attempt(uid, "Failed", reason="AppFailed", message="trainer exited with 1")


@pytest.mark.parametrize(
    ("rayjob", "is_failure"),
    [
        (None, False),
        (attempt("a"), False),
        (attempt("a", "Complete", jobStatus="SUCCEEDED"), False),
        (attempt("a", "Complete", jobStatus="FAILED"), True),
        (attempt("a", "Failed"), True),
        (attempt("a", "ValidationFailed"), True),
        (attempt("a", "Suspended"), False),
    ],
)
def test_an_attempt_has_failed_when_kuberay_says_so(
    rayjob: dict[str, Any] | None, is_failure: bool
) -> None:
    assert (attempt_failure(rayjob, T0) is not None) is is_failure


def test_a_failure_without_kubernetes_reason_is_named_by_its_state() -> None:
    failure = attempt_failure(attempt("a", "ValidationFailed"), T0)
    assert failure is not None and failure.reason == "ValidationFailed"


def reconcile(rayjob: dict[str, Any] | None, old: RLHFJobStatus, now: datetime):  # type: ignore[no-untyped-def]
    """What the reconciler does with one observation: decide, then compute the status."""
    restart = decide(POLICY, rayjob, old, now) if not finished(old) else None
    return restart, compute_status(SPEC, 1, Observed(rayjob, []), old, now, restart)


def test_failures_restart_after_the_backoff_until_max_restarts_then_fail() -> None:
    status, now = RLHFJobStatus(), T0
    for restart_number, uid in ((1, "a"), (2, "b")):
        restart, status = reconcile(failed(uid), status, now)
        assert restart.action is Action.RECORD and restart.wait_seconds == 30
        assert (status.phase, status.restarts) == (Phase.RESTARTING, restart_number)
        assert status.last_failure and status.last_failure.ray_job_uid == uid
        assert "AppFailed: trainer exited with 1" in ready_message(status)
        # Seen again before the backoff is over: wait for the rest, count nothing.
        restart, status = reconcile(failed(uid), status, now + timedelta(seconds=10))
        assert (restart.action, restart.wait_seconds) == (Action.WAIT, 20)
        assert status.restarts == restart_number
        restart, status = reconcile(failed(uid), status, now + timedelta(seconds=30))
        assert restart.action is Action.DELETE and status.phase is Phase.RESTARTING
        # Deleted: the next attempt is created and runs.
        restart, status = reconcile(None, status, now + timedelta(seconds=31))
        assert restart.action is Action.NONE and status.phase is Phase.PENDING
        restart, status = reconcile(attempt(f"{uid}2"), status, now + timedelta(seconds=40))
        assert status.phase is Phase.RUNNING and status.restarts == restart_number
        now += timedelta(minutes=10)
    restart, status = reconcile(failed("c"), status, now)
    assert restart.action is Action.NONE
    assert (status.phase, status.restarts) == (Phase.FAILED, 2) and finished(status)
    assert status.last_failure and status.last_failure.ray_job_uid == "c"
    assert "failed after its attempt failed (AppFailed" in ready_message(status)


def test_a_restart_is_counted_once_however_often_the_failure_is_seen() -> None:
    """A repeated reconcile, or a new operator reading the status the old one wrote."""
    _, status = reconcile(failed("a"), RLHFJobStatus(), T0)
    for seconds in (0, 1, 5, 29):
        _, again = reconcile(failed("a"), status, T0 + timedelta(seconds=seconds))
        assert again.restarts == 1
    reread = RLHFJobStatus.model_validate(status.to_dict())
    restart, _ = reconcile(failed("a"), reread, T0 + timedelta(seconds=31))
    assert restart.action is Action.DELETE


def test_without_restarts_a_failure_is_final_at_once() -> None:
    restart = decide(RestartPolicy(), failed("a"), RLHFJobStatus(), T0)
    assert restart.action is Action.NONE and restart.failure is not None


def ready_message(status: RLHFJobStatus) -> str:
    return next(c.message for c in status.conditions if c.type == "Ready")


def test_kuberays_long_failure_keeps_its_first_line_and_the_logs_end() -> None:
    """KubeRay's message carries up to 20,000 characters of the driver's logs: status
    keeps the first line and the end (the error); the Ready condition the first line."""
    logs = "\n".join(f"log line {i}" for i in range(3000))
    message = f"Job entrypoint command failed with exit code 1, last logs:\n{logs}\nActorDiedError"
    rayjob = attempt("a", "Failed", reason="AppFailed", message=message)
    failure = attempt_failure(rayjob, T0)
    assert failure is not None and len(failure.message) <= 1024
    assert failure.message.startswith("Job entrypoint command failed with exit code 1")
    assert failure.message.endswith("log line 2999\nActorDiedError")
    policy = RestartPolicy(max_restarts=1, backoff_seconds=0)
    status = compute_status(
        SPEC,
        1,
        Observed(rayjob, []),
        RLHFJobStatus(),
        T0,
        decide(policy, rayjob, RLHFJobStatus(), T0),
    )
    assert ready_message(status) == (
        "the job is restarting after its attempt failed (AppFailed: "
        "Job entrypoint command failed with exit code 1, last logs:)"
    )


def test_the_trainers_own_reason_says_why_the_attempt_failed_when_it_gave_one() -> None:
    """The driver patched status.training.failure before it exited (a rank out of
    memory, say): the Ready condition, and so the event, give it, not KubeRay's first
    line of the driver's logs (which stay in lastFailure)."""
    rayjob = attempt("a", "Failed", reason="AppFailed", message="Job failed, last logs:\n...")
    said = "RankOutOfMemory: actor rank 3 on pool policy (update) ran out of memory: ..."
    old = RLHFJobStatus.model_validate({"training": {"step": 7, "failure": said}})
    policy = RestartPolicy(max_restarts=1, backoff_seconds=0)
    status = compute_status(SPEC, 1, Observed(rayjob, []), old, T0, decide(policy, rayjob, old, T0))
    assert ready_message(status) == (
        f"the job is restarting after its attempt failed (AppFailed: {said})"
    )
    assert status.last_failure is not None and status.last_failure.message.startswith("Job failed")


# KubeRay's own words when its verdict came late (rayjob_controller.go).
LATE = {"reason": LATE_VERDICT, "jobStatus": "FAILED",
        "message": "The RayJob submitter finished at 2026-01-01 00:10:00 but the ray job did "
                   "not reach terminal state within 30s"}  # fmt: skip


def made_at(obj: dict[str, Any], at: str) -> dict[str, Any]:
    obj["metadata"] |= {"creationTimestamp": at}
    return obj


# As KubeRay leaves it: it asked the head while the job ran (the URL and the job's id).
HEAD = {"dashboardURL": "colocated-abcde-head-svc.ns.svc.cluster.local:8265",
        "jobId": "colocated-x7k2p"}  # fmt: skip
LATE_ATTEMPT = made_at(attempt("a", "Failed", **LATE, **HEAD), "2026-01-01T00:00:00Z")


def test_the_head_is_asked_where_kuberay_asked_it() -> None:
    assert head_job_url(LATE_ATTEMPT) == (
        "http://colocated-abcde-head-svc.ns.svc.cluster.local:8265/api/jobs/colocated-x7k2p"
    )
    assert head_job_url(attempt("a", "Failed", **LATE)) is None  # never got that far


@pytest.mark.parametrize(
    ("answer", "succeeded"),
    [
        ({"status": "SUCCEEDED", "message": "Job finished successfully."}, True),
        ({"status": "FAILED", "message": "Job entrypoint command failed with exit code 1"}, False),
        # A retried submitter (its first pod failed when the head was lost) runs `ray job
        # logs --follow`, which exits 0 whatever the job did: its exit 0 is no verdict.
        # The Ray job itself failed, and the attempt with it.
        ({"status": "FAILED", "message": "retried submitter exited 0"}, False),
        ({"status": "RUNNING"}, False),  # not ended: KubeRay's Failed stands
        (None, False),  # the head could not be asked (gone, unreachable)
    ],
    ids=["succeeded", "failed", "retried submitter, failed job", "running", "no answer"],
)
def test_kuberays_late_failure_is_decided_by_the_ray_jobs_own_status(
    answer: dict[str, Any] | None, succeeded: bool
) -> None:
    """KubeRay marks an attempt Failed, without asking the head, when it reconciles over
    30 s after the submitter ended (a loaded control plane). How the submitter exited
    does not say how the Ray job ended; the head's job API does, and without it the
    attempt is failed."""
    assert late_verdict(LATE_ATTEMPT)
    ended = as_the_ray_job_ended(LATE_ATTEMPT, answer)
    assert (attempt_failure(ended, T0) is None) is succeeded
    assert (ended is LATE_ATTEMPT) is (answer is None or answer["status"] == "RUNNING")
    _, status = reconcile(ended, RLHFJobStatus(), T0)
    assert (status.phase, status.restarts) == (
        (Phase.SUCCEEDED, 0) if succeeded else (Phase.RESTARTING, 1)
    )
    if answer is not None and answer["status"] == "FAILED":
        assert status.last_failure is not None
        assert (status.last_failure.reason, status.last_failure.message) == (
            "AppFailed", answer["message"]
        )  # fmt: skip


def test_a_ray_job_stopped_reads_as_kuberay_reads_it() -> None:
    """STOPPED (`ray job stop`): Complete, not SUCCEEDED, so the job is Failed, and no
    restart is counted, as when KubeRay's verdict comes in time."""
    ended = as_the_ray_job_ended(LATE_ATTEMPT, {"status": "STOPPED"})
    assert ended["status"]["jobDeploymentStatus"] == "Complete"
    on_time = attempt("a", "Complete", jobStatus="STOPPED")
    assert (
        reconcile(ended, RLHFJobStatus(), T0)[1].phase
        is reconcile(on_time, RLHFJobStatus(), T0)[1].phase
    )


def test_a_counted_late_failure_is_not_asked_about_again() -> None:
    _, status = reconcile(LATE_ATTEMPT, RLHFJobStatus(), T0)
    assert status.phase is Phase.RESTARTING and counted(status, LATE_ATTEMPT)
    assert not counted(RLHFJobStatus(), LATE_ATTEMPT)
    assert not counted(status, attempt("b", "Failed", **LATE))


@pytest.mark.parametrize(
    "rayjob",
    [None, failed("a"), attempt("a", "Complete", jobStatus="SUCCEEDED", reason=LATE_VERDICT)],
    ids=["none", "another reason", "its grace-period sibling"],
)
def test_only_kuberays_late_failure_is_asked_about(
    rayjob: dict[str, Any] | None,
) -> None:
    """The other path to the same reason (the Ray job ended but the deployment stayed
    Running) already carries the Ray job's own status."""
    assert not late_verdict(rayjob)


def test_a_driver_stopped_for_a_resize_under_a_late_verdict_is_replaced_not_restarted() -> None:
    """The stop for a resize exits 0 too: the attempt is replaced on the new sizes, and
    no restart is counted (what the walk-through saw fail on a loaded machine)."""
    asked = made_at(attempt("a", "Failed", **LATE, **HEAD), "2026-01-01T00:00:00Z")
    asked["metadata"]["annotations"] = {STOP_ASKED: "value: 1 to 2"}
    asked["spec"] = {"rayClusterSpec": {"workerGroupSpecs": [
        {"groupName": pool.name, "replicas": pool.replicas} for pool in SPEC.pools]}}  # fmt: skip
    ended = as_the_ray_job_ended(asked, {"status": "SUCCEEDED"})
    assert decide(POLICY, ended, RLHFJobStatus(), T0).action is Action.NONE
    assert decide_resize(SPEC, ended, None).action is ResizeAction.REPLACE


def test_a_submitter_out_of_retries_says_the_head_was_lost_too_often() -> None:
    """Each Ray head lost in an attempt fails the submitter's pod once; after the
    rendered retries KubeRay fails the RayJob with its Job's reason. The failure says
    what happened, in the job's terms, keeping KubeRay's words."""
    kuberays = (
        "Job submission has failed. Reason: BackoffLimitExceeded. "
        "Message: Job has reached the specified backoff limit"
    )
    rayjob = attempt("a", "Failed", reason="SubmissionFailed", message=kuberays)
    failure = attempt_failure(rayjob, T0)
    assert failure is not None and failure.reason == "SubmitterRetriesExhausted"
    assert failure.message.startswith("the Ray head was lost 3 times in this attempt")
    assert failure.message.endswith(f"KubeRay: {kuberays}")
    rendered = render_rayjob(JobRef("colocated", "ns", "uid"), SPEC)
    assert rendered["spec"]["submitterConfig"] == {"backoffLimit": 2}
    other = attempt("a", "Failed", reason="SubmissionFailed", message="image pull failed")
    assert (attempt_failure(other, T0) or failure).reason == "SubmissionFailed"
