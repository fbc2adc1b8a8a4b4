"""What a reconcile says about a job besides its children: the status patch, and the
messages of its Events."""

from __future__ import annotations

from rlhf_operator.api.job import Phase, RLHFJobStatus
from rlhf_operator.controller.heads import LOST_UNSEEN
from rlhf_operator.controller.kube import Obj


def driver_restart_message(old: RLHFJobStatus, new: RLHFJobStatus) -> str:
    failure = new.last_failure
    why = f" ({failure.reason})" if failure and failure.reason != LOST_UNSEEN else ""
    return (
        f"the Ray head {old.ray_head} of cluster {new.ray_cluster} was lost{why} and KubeRay made "
        f"{new.ray_head}: the trainer's driver starts again there and resumes from the "
        f"newest checkpoint; the workers of the lost head are replaced "
        f"({new.driver_restarts} time(s) in this job)"
    )


def status_patch(old: RLHFJobStatus, new: RLHFJobStatus) -> Obj | None:
    """The merge patch of the status from `old` to `new`, None if nothing changed. The
    trainer's `training` is left alone. A merge patch removes a field only given null:
    a field `new` no longer has (no head while a new attempt's is made, no resize) is
    sent as null, or the stale value would stay."""
    mine, before = new.to_dict(), old.to_dict()
    mine.pop("training", None)
    before.pop("training", None)
    if mine == before:
        return None
    return mine | dict.fromkeys(before.keys() - mine.keys())


def phase_message(status: RLHFJobStatus) -> str:
    """The Ready condition's message; a restart also says where the next attempt starts."""
    ready = next((c.message for c in status.conditions if c.type == "Ready"), None)
    message = ready or f"the job is {status.phase.value.lower()}"
    if status.phase is Phase.RESTARTING:
        checkpoint = status.training.last_checkpoint if status.training else None
        start = (
            f"resumes from {checkpoint}"
            if checkpoint
            else "starts from scratch (no checkpoint yet)"
        )
        message += f"; restart {status.restarts}: the next attempt {start}"
    return message


def invalid_message(status: RLHFJobStatus) -> str | None:
    invalid = next((c for c in status.conditions if c.type == "Invalid"), None)
    return invalid.message if invalid and invalid.status == "True" else None
