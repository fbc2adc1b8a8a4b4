"""Which fields may change on an existing job: the CRD's transition rules, evaluated as
the API server does on an update (the control-plane tests repeat this on a real one)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from rlhf_operator.api.crd import RESIZE_MESSAGE
from tests.unit.celcheck import cel_errors
from tests.unit.conftest import EXAMPLES, load

Job = dict[str, Any]


def changed(job: Job, change: Callable[[Job], None]) -> Job:
    new = copy.deepcopy(job)
    change(new)
    return new


ALLOWED = {
    "suspend": lambda j: j["spec"].update(suspend=True),
    "status-only": lambda j: j.update(status={"phase": "Running"}),
}

REJECTED = {
    "pool-gpus": (lambda j: j["spec"]["pools"][0].update(gpusPerNode=2), "spec.pools[0].gpusPerNode",
                  "only a pool's replicas can change after creation"),
    "pool-node-selector-added": (lambda j: j["spec"]["pools"][1].update(nodeSelector={"pool": "b"}), "spec.pools[1].nodeSelector",
                                 "only a pool's replicas can change after creation"),
    "pool-added": (lambda j: j["spec"]["pools"].append({"name": "extra", "gpusPerNode": 1}), "spec.pools",
                   "pools cannot be added, removed or renamed after creation"),
    "trained-pool-replicas-without-checkpoints": (
        lambda j: j["spec"]["pools"][0].update(replicas=2), "spec.pools", RESIZE_MESSAGE),
    "pool-renamed": (lambda j: j["spec"]["pools"][1].update(name="critic"), "spec.pools",
                     "pools cannot be added, removed or renamed after creation"),
    "roles": (lambda j: j["spec"]["roles"].update(ref="value"), "spec.roles", "cannot change after creation"),
    "async-added": (lambda j: j["spec"].update({"async": {}}), "spec.async", "cannot change after creation"),
    "trainer": (lambda j: j["spec"]["trainer"].update(totalSteps=99), "spec.trainer", "cannot change after creation"),
    "image": (lambda j: j["spec"].update(image="other:1"), "spec.image", "cannot change after creation"),
    "default-made-explicit-but-different": (lambda j: j["spec"].update(separation="gpu"), "spec.separation",
                                            "cannot change after creation"),
}  # fmt: skip


@pytest.mark.parametrize("change", ALLOWED.values(), ids=ALLOWED.keys())
def test_mutable_fields_may_change(local_job: Job, change: Callable[[Job], None]) -> None:
    assert cel_errors(changed(local_job, change), old=local_job) == []


@pytest.mark.parametrize(("change", "path", "message"), REJECTED.values(), ids=REJECTED.keys())
def test_fixed_fields_are_rejected_with_the_field_named(
    local_job: Job, change: Callable[[Job], None], path: str, message: str
) -> None:
    errors = cel_errors(changed(local_job, change), old=local_job)
    assert (path, message) in [(p, m[: len(message)]) for p, m in errors], errors


def test_restating_a_default_is_not_a_change(local_job: Job) -> None:
    explicit = changed(local_job, lambda j: j["spec"].update(separation="node", suspend=False))
    assert cel_errors(explicit, old=local_job) == []


def test_a_trained_pool_may_change_size_when_the_job_keeps_checkpoints(local_job: Job) -> None:
    local_job["spec"]["checkpointClaim"] = "checkpoints"
    grown = changed(local_job, lambda j: j["spec"]["pools"][0].update(replicas=2))
    assert cel_errors(grown, old=local_job) == []


def test_a_fully_async_jobs_own_rollout_pool_may_change_size_without_checkpoints(
    local_job: Job,
) -> None:
    spec = local_job["spec"]
    spec["pools"].append({"name": "rollout", "replicas": 1, "gpusPerNode": 1})
    spec["roles"]["rollout"] = "rollout"
    spec["async"] = {}
    grown = changed(local_job, lambda j: j["spec"]["pools"][2].update(replicas=3))
    assert cel_errors(grown, old=local_job) == []
    # Not so once another role shares it: the ref scores on it.
    spec["roles"]["ref"] = "rollout"
    shared = changed(local_job, lambda j: j["spec"]["pools"][2].update(replicas=3))
    assert ("spec.pools", RESIZE_MESSAGE) in cel_errors(shared, old=local_job)


def test_an_environments_replicas_may_change_while_the_job_runs_and_nothing_else() -> None:
    """The trainer spreads sessions over whatever replicas the headless Service answers
    with (rlhf_env.replicas), so only replicas may change; the rest is fixed."""
    job = load(EXAMPLES[0].parent / "agentic-cluster.yaml")
    scaled = changed(job, lambda j: j["spec"]["environments"][0].update(replicas=3))
    assert cel_errors(scaled, old=job) == []
    other_class = changed(job, lambda j: j["spec"]["environments"][0].update(serve="m:Other"))
    assert (
        "spec.environments[0].serve",
        "only an environment's replicas can change after creation",
    ) in (cel_errors(other_class, old=job))
    added = {"name": "extra", "url": "http://tools:8000"}
    more = changed(job, lambda j: j["spec"]["environments"].append(added))
    assert ("spec.environments", "environments cannot be added, removed or renamed after "
            "creation") in cel_errors(more, old=job)  # fmt: skip
    none = changed(job, lambda j: j["spec"].pop("environments"))
    assert ("spec.environments", "environments cannot be added or removed after creation") in (
        cel_errors(none, old=job)
    )
