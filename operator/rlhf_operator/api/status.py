"""The RLHFJob's status: what the operator observed and the trainer reported. The
operator writes all of it but `training`, which the trainer patches from its head pod."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field

from rlhf_trainer.api.progress import PoolResize, TrainingProgress
from rlhf_trainer.api.rules import SpecModel


class Phase(StrEnum):
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    RESTARTING = "Restarting"  # an attempt failed; the next one starts after the backoff
    QUEUED = "Queued"  # waiting for Kueue to admit it (spec.queueName)
    # A pool that trains changed size: the trainer checkpoints at its next step and the
    # next attempt resumes on the new sizes (not counted as a restart).
    RESIZING = "Resizing"


class StatusModel(SpecModel):
    # Status is written by two parties (operator and trainer) that may run different
    # versions; unknown fields are dropped rather than failing the reader.
    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """A Kubernetes condition (Ready, PoolsReady, EnvironmentsReady, AgentsReady, Invalid)."""

    type: str = Field(description="Condition type, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field("", description="CamelCase reason for the last transition.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: datetime | None = Field(None, description="When status last changed.")
    observed_generation: int | None = Field(None, description="Spec generation it reflects.")


class PoolStatus(StatusModel):
    """GPUs of one pool: desired by the spec, ready in running worker pods."""

    name: str = Field(description="Pool name.")
    desired_gpus: int = Field(0, alias="desiredGPUs", description="GPUs the spec asks for.")
    ready_gpus: int = Field(0, alias="readyGPUs", description="GPUs in running worker pods.")
    nodes: list[str] = Field(default_factory=list, description="Nodes hosting the pool.")


class AttemptFailure(StatusModel):
    """How an attempt (a RayJob) failed, as KubeRay reported it."""

    reason: str = Field("", description="KubeRay's reason, e.g. AppFailed or DeadlineExceeded.")
    message: str = Field("", description="KubeRay's message.")
    time: datetime | None = Field(None, description="When the operator saw the failure.")
    ray_job_uid: str = Field("", alias="rayJobUID", description="The failed RayJob's uid.")


class RLHFJobStatus(StatusModel):
    """Observed state. The operator writes all but `training`, which the trainer writes."""

    phase: Phase = Field(Phase.PENDING, description="Lifecycle phase.")
    observed_generation: int | None = Field(None, description="Spec generation last acted on.")
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")
    pools: list[PoolStatus] = Field(default_factory=list, description="Per-pool GPUs.")
    pools_ready: str | None = Field(None, description="Ready pools / pools, e.g. '1/2'.")
    training: TrainingProgress | None = Field(None, description="Written by the trainer.")
    ray_job: str | None = Field(None, description="Name of the RayJob.")
    ray_cluster: str | None = Field(None, description="Name of the RayCluster running the job.")
    start_time: datetime | None = Field(None, description="When the job started running.")
    completion_time: datetime | None = Field(None, description="When the job finished.")
    restarts: int = Field(0, ge=0, description="New attempts started after failures.")
    ray_head: str | None = Field(
        None, description="The Ray head pod of the running attempt (its driver runs there)."
    )
    driver_restarts: int = Field(
        0,
        ge=0,
        description=(
            "Times the running attempt's Ray head was lost and KubeRay made a new one: the "
            "trainer's driver starts again there and resumes from the newest checkpoint "
            "(not a new attempt: restarts does not count it)."
        ),
    )
    last_failure: AttemptFailure | None = Field(None, description="The last failed attempt.")
    resizing: list[PoolResize] | None = Field(
        None,
        description=(
            "While Resizing: the pools that change size, old and new. The trainer reads it "
            "to stop at a step boundary after a checkpoint."
        ),
    )
