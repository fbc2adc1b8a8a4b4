"""Resize decisions and the status they lead to (pure): a pool's replicas changed while
an attempt runs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from rlhf_operator.api.job import Phase, RLHFJobSpec, RLHFJobStatus
from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.resizes import (
    STOP_ASKED,
    ResizeAction,
    decide_resize,
    stop_asked_patch,
)
from rlhf_operator.controller.status import Observed, compute_status
from rlhf_operator.render.children import JobRef, render_children
from rlhf_trainer.api.progress import OutputProgress, PoolResize, TrainingProgress
from tests.unit.conftest import EXAMPLES, load

REF = JobRef("job", "team", "uid-1")
REF_TIME = datetime(2026, 1, 1, tzinfo=UTC)


def spec_of(example: str, checkpoints: bool = True, **replicas: int) -> RLHFJobSpec:
    manifest = load(EXAMPLES[0].parent / example)
    for pool in manifest["spec"]["pools"]:
        pool["replicas"] = replicas.get(pool["name"], pool.get("replicas", 1))
    if checkpoints:
        manifest["spec"]["checkpointClaim"] = "checkpoints"
    return parse_job(manifest).spec


def attempt(
    spec: RLHFJobSpec, deployment: str = "Running", asked: bool = False, **status: str
) -> dict[str, Any]:
    """The RayJob the operator renders for `spec`, as KubeRay reports it; `asked`: its
    driver was asked to stop for a resize (the operator's annotation on it)."""
    rayjob = render_children(REF, spec, None)[-1]
    rayjob["metadata"]["uid"] = "attempt-1"
    if asked:
        resize = PoolResize(pool="policy", from_replicas=1, to_replicas=2)
        rayjob["metadata"].setdefault("annotations", {}).update(
            stop_asked_patch((resize,))["metadata"]["annotations"]
        )
    rayjob["status"] = {"jobDeploymentStatus": deployment, **status}
    return rayjob


SPLIT = "two-nodes-by-node-8-8.yaml"  # policy: actor, ref; value: critic; synchronous
ASYNC = "fully-async.yaml"
AT_STEP_3 = TrainingProgress(step=3, total_steps=10)
DONE = TrainingProgress(step=10, total_steps=10)
SUCCEEDED = {"deployment": "Complete", "jobStatus": "SUCCEEDED"}


def test_a_trained_pool_that_grows_under_a_running_driver_waits_for_its_step_boundary() -> None:
    running = attempt(spec_of(SPLIT))
    decision = decide_resize(spec_of(SPLIT, policy=2), running, AT_STEP_3)
    assert decision.action is ResizeAction.WAIT
    assert decision.resizes == (PoolResize(pool="policy", from_replicas=1, to_replicas=2),)


def test_an_attempt_whose_driver_stopped_early_is_replaced_and_one_that_finished_is_not() -> None:
    stopped = attempt(spec_of(SPLIT), asked=True, **SUCCEEDED)
    assert stopped["metadata"]["annotations"][STOP_ASKED] == "policy: 1 to 2"
    resized = spec_of(SPLIT, policy=2)
    assert decide_resize(resized, stopped, AT_STEP_3).action is ResizeAction.REPLACE
    assert decide_resize(resized, stopped, DONE).action is ResizeAction.NONE
    # The size put back meanwhile: still a new attempt, else the job would end early.
    assert decide_resize(spec_of(SPLIT), stopped, AT_STEP_3).action is ResizeAction.REPLACE
    # Its stop report lost too: the next attempt resumes from the newest checkpoint.
    assert decide_resize(spec_of(SPLIT), stopped, None).action is ResizeAction.REPLACE


@pytest.mark.parametrize("training", [AT_STEP_3, None], ids=["stale report", "no report"])
def test_an_attempt_never_asked_to_stop_that_exits_0_has_succeeded_whatever_it_reported(
    training: TrainingProgress | None,
) -> None:
    """A trainer whose reports are lost (a PATCH refused, a default-deny egress) is not
    replaced for ever: the status says it succeeded, and that its reports never came."""
    spec = spec_of(SPLIT)
    ended = attempt(spec, **SUCCEEDED)
    decision = decide_resize(spec, ended, training)
    assert decision.action is ResizeAction.NONE
    old = RLHFJobStatus(phase=Phase.RUNNING, training=training)
    status = compute_status(spec, 1, Observed(ended, []), old, REF_TIME, None, decision)
    assert status.phase is Phase.SUCCEEDED
    ready = next(c for c in status.conditions if c.type == "Ready")
    last = "step 3 of 10" if training else "none"
    assert f"the trainer's last report is {last}" in ready.message
    assert "did not reach the job's status" in ready.message


def test_a_job_that_succeeded_with_an_output_says_where_its_trained_policy_is() -> None:
    spec = spec_of(SPLIT)
    ended = attempt(spec, **SUCCEEDED)
    output = OutputProgress(path="/checkpoints/model", step=10, dtype="bf16")
    training = TrainingProgress(step=10, total_steps=10, output=output)
    decision = decide_resize(spec, ended, training)
    old = RLHFJobStatus(phase=Phase.RUNNING, training=training)
    status = compute_status(spec, 1, Observed(ended, []), old, REF_TIME, None, decision)
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert (status.phase, ready.message) == (
        Phase.SUCCEEDED,
        "the job is succeeded: the trained policy (step 10) is at /checkpoints/model, "
        "a Hugging Face directory in bf16",
    )


@pytest.mark.parametrize("deployment", ["", "Initializing", "Suspended"])
def test_an_attempt_with_no_driver_yet_is_replaced_at_once(deployment: str) -> None:
    starting = attempt(spec_of(SPLIT, policy=4), deployment)  # say, 4 nodes never came
    decision = decide_resize(spec_of(SPLIT, policy=2), starting, None)
    assert decision.action is ResizeAction.REPLACE
    assert decision.resizes == (PoolResize(pool="policy", from_replicas=4, to_replicas=2),)


@pytest.mark.parametrize("deployment", ["Failed", "ValidationFailed"])
def test_a_failed_attempt_is_left_to_the_restart_rules(deployment: str) -> None:
    failed = attempt(spec_of(SPLIT), deployment)
    assert decide_resize(spec_of(SPLIT, policy=2), failed, AT_STEP_3).action is ResizeAction.NONE


def test_fully_asyncs_own_rollout_pool_changes_in_place_and_the_trained_one_does_not() -> None:
    spec = spec_of(ASYNC)
    rollout, trained = spec.roles.rollout, spec.roles.actor
    assert spec.elastic_pools == {rollout}
    running = attempt(spec)
    grown = spec_of(ASYNC, **{rollout: 3})
    assert decide_resize(grown, running, AT_STEP_3).action is ResizeAction.NONE
    both = spec_of(ASYNC, **{rollout: 3, trained: 2})
    decision = decide_resize(both, running, AT_STEP_3)
    assert [r.pool for r in decision.resizes] == [trained]


def test_a_job_without_checkpoints_is_never_stopped_for_a_resize() -> None:
    running = attempt(spec_of(SPLIT, checkpoints=False))
    resized = spec_of(SPLIT, checkpoints=False, policy=2)
    assert decide_resize(resized, running, AT_STEP_3).action is ResizeAction.NONE


def test_the_status_says_resizing_with_the_old_and_new_sizes_and_counts_no_restart() -> None:
    spec = spec_of(SPLIT, policy=2)
    old = RLHFJobStatus(phase=Phase.RUNNING, training=AT_STEP_3)
    for rayjob, action in ((attempt(spec_of(SPLIT)), "WAIT"),
                           (attempt(spec_of(SPLIT), asked=True, **SUCCEEDED), "REPLACE")):  # fmt: skip
        decision = decide_resize(spec, rayjob, old.training)
        assert decision.action is ResizeAction[action]
        status = compute_status(spec, 2, Observed(rayjob, []), old, REF_TIME, None, decision)
        assert status.phase is Phase.RESIZING and status.completion_time is None
        assert status.restarts == 0
        assert status.resizing == [PoolResize(pool="policy", from_replicas=1, to_replicas=2)]
        ready = next(c for c in status.conditions if c.type == "Ready")
        assert (ready.status, ready.reason) == ("False", "Resizing")
        assert "resizing pool policy from 1 to 2 nodes" in ready.message
    # The next attempt, on the new sizes: no longer resizing.
    decision = decide_resize(spec, attempt(spec), old.training)
    status = compute_status(spec, 2, Observed(attempt(spec), []), old, REF_TIME, None, decision)
    assert (status.phase, status.resizing) == (Phase.RUNNING, None)
