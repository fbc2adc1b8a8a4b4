"""Every example a user may copy is valid, admitted by the CRD's rules, and plans as meant."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import Mode, plan_placement
from tests.unit.celcheck import cel_errors
from tests.unit.conftest import EXAMPLES, load

EXPECTED = {
    "agentic-cluster.yaml": (Mode.SPLIT, {"policy": 1, "value": 1}),
    "agentic-tools.yaml": (Mode.COLOCATED, {"policy": 1}),
    "asymmetric-3-5.yaml": (Mode.SPLIT, {"policy": 3, "value": 5}),
    "asymmetric-6-2.yaml": (Mode.SPLIT, {"policy": 6, "value": 2}),
    "colocated.yaml": (Mode.COLOCATED, {"all": 8}),
    "cpu-cluster.yaml": (Mode.SPLIT, {"policy": 1, "value": 1}),
    "fully-async.yaml": (Mode.ASYNC, {"rollout": 8, "trainer": 8}),
    "grpo-split.yaml": (Mode.SPLIT, {"train": 8, "generate": 8}),
    "local-cpu.yaml": (Mode.SPLIT, {"policy": 1, "value": 1}),
    "lora-grpo.yaml": (Mode.COLOCATED, {"all": 8}),
    "split-8gpu-4-4.yaml": (Mode.SPLIT, {"actor-rollout-ref": 4, "critic": 4}),
    "two-nodes-by-node-8-8.yaml": (Mode.SPLIT, {"policy": 8, "value": 8}),
    "two-nodes-per-node-4-4.yaml": (Mode.SPLIT, {"actor-rollout-ref": 8, "critic": 8}),
}


def test_every_example_is_listed_here() -> None:
    assert sorted(p.name for p in EXAMPLES) == sorted(EXPECTED)


def test_examples_can_be_applied_side_by_side() -> None:
    names = [load(p)["metadata"]["name"] for p in EXAMPLES]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid_and_plans_as_documented(path: Path) -> None:
    manifest = load(path)
    job = parse_job(manifest)
    assert cel_errors(manifest) == []
    plan = plan_placement(job.spec.job_config())
    mode, gpus = EXPECTED[path.name]
    assert plan.mode is mode
    assert {p.name: p.total_gpus for p in plan.pools} == gpus


def test_the_trainer_receives_only_its_part_of_the_spec() -> None:
    spec = parse_job(load(EXAMPLES[0].parent / "split-8gpu-4-4.yaml")).spec
    handed_over = spec.job_config().model_dump_json(by_alias=True, exclude_none=True)
    config = JobConfig.model_validate_json(handed_over)  # what the trainer image does
    assert "nodeSelector" not in handed_over and "image" not in handed_over
    assert [p.name for p in config.pools] == [p.name for p in spec.pools]
    assert config.roles == spec.roles and config.trainer == spec.trainer
