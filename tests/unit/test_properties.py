"""Property-based tests: random specs never crash validation, valid specs round-trip,
and the CRD's CEL rules reject exactly the specs the Python rules reject."""

from __future__ import annotations

import json
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError

from rlhf_operator.api.job import RLHFJob
from rlhf_operator.api.validation import InvalidJob, parse_job
from rlhf_trainer.api.rules import RuleViolations, dotted
from tests.unit.celcheck import cel_errors
from tests.unit.strategies import damaged_jobs, rule_damaged_jobs, valid_jobs

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(valid_jobs())
def test_valid_specs_pass_both_validators(manifest: dict[str, Any]) -> None:
    parse_job(manifest)
    assert cel_errors(manifest) == []


@SETTINGS
@given(valid_jobs())
def test_valid_specs_round_trip_through_json_and_yaml(manifest: dict[str, Any]) -> None:
    job = parse_job(manifest)
    wire = job.to_dict()
    assert RLHFJob.model_validate_json(json.dumps(wire)) == job
    assert parse_job(yaml.safe_load(yaml.safe_dump(wire))) == job
    assert parse_job(wire).to_dict() == wire


@SETTINGS
@given(damaged_jobs())
def test_random_specs_raise_nothing_but_a_validation_error(manifest: Any) -> None:
    try:
        parse_job(manifest)
    except InvalidJob as invalid:
        assert invalid.errors and all(e.message for e in invalid.errors)


def _broken_rule_paths(manifest: Any) -> tuple[set[str], bool] | None:
    """Paths of broken cross-field rules, and whether any belongs to a nested model;
    None if a field-level check failed first."""
    try:
        RLHFJob.model_validate(manifest)
    except ValidationError as error:
        paths, nested = set(), False
        for item in error.errors():
            cause = (item.get("ctx") or {}).get("error")
            if not isinstance(cause, RuleViolations):
                return None
            nested |= item["loc"] != ("spec",)
            for rule, _ in cause.broken:
                paths.add(dotted((*item["loc"], *([rule.field] if rule.field else []))))
        return paths, nested
    return set(), False


@SETTINGS
@given(rule_damaged_jobs())
def test_cel_rules_agree_with_python_rules(manifest: Any) -> None:
    broken = _broken_rule_paths(manifest)
    assert broken is not None, "the strategy should only break cross-field rules"
    python_paths, nested = broken
    cel_paths = {path for path, _ in cel_errors(manifest)}
    if nested:
        # pydantic runs a model's rules only once its nested models are valid; the API
        # server runs them all at once, so it may name more of the problems at once.
        assert python_paths <= cel_paths
    else:
        assert cel_paths == python_paths
