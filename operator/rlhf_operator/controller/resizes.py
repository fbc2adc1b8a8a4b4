"""Pure resize decisions: a pool's `replicas` changed in the spec -> what happens to the
running attempt.

A pool whose size may change under a running trainer (fully async's own rollout pool,
`JobConfig.elastic_pools`) is scaled in place: the trainer takes in or lets go of its
engines. Any other pool trains or scores, and its ranks cannot come or go mid-step, so
its new size needs a new attempt. An attempt keeps the sizes it was created with (its
RayJob's worker groups); while the spec differs:
- no driver runs yet (the cluster still starting, suspended or queued): the attempt is
  replaced at once, as it has nothing to lose;
- the driver runs: the job is Resizing. The trainer sees that in status, checkpoints at
  the end of its step and exits 0 (loop.resize);
- an attempt that so exited before its last step is replaced. The next one resumes from
  that checkpoint on the new sizes. It is not a failure: maxRestarts does not count it.
  Which attempts were asked to stop is recorded on the attempt itself (STOP_ASKED), at
  the ask: the trainer's last report can be lost, and the spec may be put back before
  the driver exits, so neither tells a stop from an end whose final report never came.
A job that keeps no checkpoints would lose its steps: admission refuses such resizes
(the CRD's transition rule), and they are left to wait here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rlhf_operator.api.job import RLHFJobSpec
from rlhf_trainer.api.progress import PoolResize, TrainingProgress

DRIVER_RUNNING = "Running"  # KubeRay's jobDeploymentStatus once the driver is submitted
# On a RayJob whose driver was asked to stop for a resize: the resizes, as asked.
STOP_ASKED = "rlhf.dev/stop-asked-for-resize"


class ResizeAction(StrEnum):
    NONE = "none"  # the attempt's sizes are the spec's, or it ended for good
    WAIT = "wait"  # Resizing: the trainer stops at its next step boundary
    REPLACE = "replace"  # delete the attempt; the next one has the spec's sizes


@dataclass(frozen=True)
class ResizeDecision:
    action: ResizeAction
    resizes: tuple[PoolResize, ...] = ()


def attempt_sizes(rayjob: dict[str, Any]) -> dict[str, int]:
    """Pool -> nodes, as the attempt (its RayJob) was created with."""
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return {group["groupName"]: group["replicas"] for group in groups}


def pending_resizes(spec: RLHFJobSpec, rayjob: dict[str, Any]) -> tuple[PoolResize, ...]:
    """The pools, other than the elastic ones, whose size the attempt does not have."""
    sizes = attempt_sizes(rayjob)
    return tuple(
        PoolResize(pool=pool.name, from_replicas=sizes[pool.name], to_replicas=pool.replicas)
        for pool in spec.pools
        if pool.name not in spec.elastic_pools
        and sizes.get(pool.name, pool.replicas) != pool.replicas
    )


def succeeded(rayjob: dict[str, Any]) -> bool:
    status = rayjob.get("status") or {}
    return (status.get("jobDeploymentStatus"), status.get("jobStatus")) == ("Complete", "SUCCEEDED")


def stop_asked(rayjob: dict[str, Any]) -> bool:
    return STOP_ASKED in (rayjob["metadata"].get("annotations") or {})


def stop_asked_patch(resizes: tuple[PoolResize, ...]) -> dict[str, Any]:
    """The merge patch that records on a RayJob that its driver was asked to stop."""
    asked = "; ".join(f"{r.pool}: {r.from_replicas} to {r.to_replicas}" for r in resizes)
    return {"metadata": {"annotations": {STOP_ASKED: asked}}}


def stopped_early(rayjob: dict[str, Any], training: TrainingProgress | None) -> bool:
    """The driver, asked to stop for a resize, exited 0 before the last step it knew of.

    Without the ask, an exit 0 is the end, whatever the last report says (it may have
    been lost). With it, the last report may be lost too: then the next attempt resumes
    from the newest checkpoint, which at the end trains nothing more."""
    done = training is not None and 0 < training.total_steps <= training.step
    return succeeded(rayjob) and stop_asked(rayjob) and not done


def decide_resize(
    spec: RLHFJobSpec, rayjob: dict[str, Any] | None, training: TrainingProgress | None
) -> ResizeDecision:
    """What to do with the attempt `rayjob` (None: none yet) given the spec's sizes and
    the trainer's last report. A failed attempt is left to the restart rules: the next
    attempt has the spec's sizes anyway."""
    if rayjob is None or spec.checkpoint_path is None:
        return ResizeDecision(ResizeAction.NONE)
    resizes = pending_resizes(spec, rayjob)
    if stopped_early(rayjob, training):
        return ResizeDecision(ResizeAction.REPLACE, resizes)
    deployment = (rayjob.get("status") or {}).get("jobDeploymentStatus", "")
    if not resizes or deployment in ("Complete", "Failed", "ValidationFailed"):
        return ResizeDecision(ResizeAction.NONE)
    if deployment == DRIVER_RUNNING:
        return ResizeDecision(ResizeAction.WAIT, resizes)
    return ResizeDecision(ResizeAction.REPLACE, resizes)
