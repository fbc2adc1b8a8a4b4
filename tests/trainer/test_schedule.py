"""The loop runs the placement plan's stages: every phase a plan can schedule on a pool
has a worker method on its role's worker, which takes the stage's arguments."""

from __future__ import annotations

import inspect

import pytest

from rlhf_trainer.api.plan import PHASE_ROLE, STEP_STAGES, Phase
from rlhf_trainer.cluster.role_groups import WORKERS
from rlhf_trainer.loop.sync import PHASE_METHOD

# The arguments the loop passes each stage's calls after the batch (or prompt shard).
# generate's attempt: dynamic sampling's further rounds of a step.
STAGE_ARGUMENTS = {"generate": ["step", "attempt"], "score": [], "update": ["step"]}


@pytest.mark.parametrize(
    "stage, phase",
    [(name, phase) for name, phases in STEP_STAGES if name != "sync" for phase in phases],
)
def test_every_scheduled_phase_has_a_worker_method(stage: str, phase: Phase) -> None:
    method = getattr(WORKERS[PHASE_ROLE[phase]].load(), PHASE_METHOD[phase])
    parameters = list(inspect.signature(method).parameters)
    assert parameters[2:] == STAGE_ARGUMENTS[stage], f"{phase}: {parameters}"


def test_the_loop_names_no_phase_the_plan_does_not_schedule() -> None:
    scheduled = {phase for name, phases in STEP_STAGES if name != "sync" for phase in phases}
    assert set(PHASE_METHOD) == scheduled
