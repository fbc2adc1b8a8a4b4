"""The EnvironmentsReady condition from the environments' Deployments and pods (pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from rlhf_operator.api.job import Condition, RLHFJobSpec, RLHFJobStatus
from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.environments import Verdict, environments_ready
from rlhf_operator.controller.status import Observed, compute_status, warnings
from tests.unit.conftest import EXAMPLES, load

T0 = datetime(2026, 1, 1, tzinfo=UTC)
JOB = load(EXAMPLES[0].parent / "agentic-cluster.yaml")  # one environment: lookup
SPEC = parse_job(JOB).spec


def spec_with(*environments: dict[str, Any]) -> RLHFJobSpec:
    return parse_job({**JOB, "spec": {**JOB["spec"], "environments": list(environments)}}).spec


TWO = spec_with(
    {"name": "lookup", "serve": "rlhf_env.toys:LetterLookup", "replicas": 2},
    {"name": "sandbox", "image": "sandbox:2", "command": ["serve"]},
    {"name": "search", "url": "http://search.tools:8000"},  # not the operator's to run
)


def deployment(
    env: str,
    replicas: int = 1,
    ready: int = 1,
    generation: int = 1,
    status: dict[str, int] | None = None,
) -> dict[str, Any]:
    """As the API server has it once its controller saw generation `generation`."""
    return {
        "kind": "Deployment",
        "metadata": {"name": f"agentic-cluster-env-{env}", "generation": generation},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"rlhf.dev/job": "j", "rlhf.dev/environment": env}},
        },
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            **(status or {}),
        },
    }


def env_pod(env: str, name: str, **status: Any) -> dict[str, Any]:
    labels = {"rlhf.dev/job": "j", "app.kubernetes.io/component": "environment"}
    return {
        "metadata": {"name": name, "labels": {**labels, "rlhf.dev/environment": env}},
        "status": {"phase": "Pending", **status},
    }


def unschedulable(env: str, name: str, message: str) -> dict[str, Any]:
    placed = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    return env_pod(env, name, conditions=[{**placed, "message": message}])


def waiting(env: str, name: str, reason: str, message: str = "") -> dict[str, Any]:
    state = {"waiting": {"reason": reason, "message": message}}
    return env_pod(env, name, containerStatuses=[{"name": "environment", "state": state}])


def condition(observed: Observed, spec: RLHFJobSpec = SPEC) -> Condition | None:
    status = compute_status(spec, 2, observed, RLHFJobStatus(), T0)
    return next((c for c in status.conditions if c.type == "EnvironmentsReady"), None)


def test_a_job_without_environments_the_operator_runs_has_no_such_condition() -> None:
    no_environments = parse_job(load(EXAMPLES[0].parent / "asymmetric-6-2.yaml")).spec
    assert condition(Observed(None, []), no_environments) is None
    only_urls = spec_with({"name": "lookup", "url": "http://lookup.tools:8000"})
    assert environments_ready(only_urls, [], []) is None


def test_every_replica_ready_is_environments_ready() -> None:
    ready = condition(Observed(None, [], deployments=[deployment("lookup")]))
    assert ready is not None
    assert (ready.status, ready.reason, ready.message, ready.observed_generation) == (
        "True",
        "EnvironmentsReady",
        "1/1 environments have all their replicas ready",
        2,
    )
    both = [deployment("lookup", replicas=2, ready=2), deployment("sandbox")]
    assert environments_ready(TWO, both, []) == Verdict(
        True, "EnvironmentsReady", "2/2 environments have all their replicas ready"
    )


def test_replicas_on_their_way_say_how_many_are_ready() -> None:
    pods = [waiting("lookup", "lookup-a", "ContainerCreating"), env_pod("lookup", "lookup-b")]
    verdict = environments_ready(
        TWO, [deployment("lookup", replicas=2, ready=1), deployment("sandbox")], pods
    )
    assert verdict == Verdict(
        False,
        "EnvironmentsNotReady",
        "1/2 environments have all their replicas ready; environment lookup: 1 of 2 replicas ready",
    )
    assert environments_ready(TWO, [deployment("lookup", replicas=2, ready=2)], []) == Verdict(
        False,
        "EnvironmentsNotReady",
        "1/2 environments have all their replicas ready; "
        "environment sandbox: 0 of 1 replicas ready (no Deployment yet)",
    )


@pytest.mark.parametrize(
    "status",
    [
        {"observedGeneration": 1},  # its controller has not seen generation 2 yet
        {"replicas": 2},  # a pod of the old template is left
        {"updatedReplicas": 0},  # the ready pod is of the old template
    ],
)
def test_a_deployment_rolling_out_a_change_is_not_ready(status: dict[str, int]) -> None:
    generation = 2 if "observedGeneration" in status else 1
    rolling = deployment("lookup", generation=generation, status=status)
    verdict = environments_ready(SPEC, [rolling], [])
    assert verdict is not None and not verdict.ok
    assert verdict.message.endswith(
        "environment lookup: 1 of 1 replicas ready, rolling out a change"
    )


def test_a_pod_the_scheduler_cannot_place_names_the_environment_the_pod_and_why() -> None:
    said = "0/5 nodes are available:\n 1 Insufficient cpu, 4 node(s) had untolerated taint."
    pods = [
        unschedulable("sandbox", "sandbox-x", said),
        unschedulable("sandbox", "sandbox-y", said),  # one pod says it for the environment
        waiting("lookup", "lookup-a", "CrashLoopBackOff", "back-off 10s"),
    ]
    verdict = environments_ready(
        TWO, [deployment("lookup", 2, 1), deployment("sandbox", 1, 0)], pods
    )
    assert verdict == Verdict(
        False,
        "Unschedulable",  # over PodsFailing: nothing runs until the scheduler places it
        "0/2 environments have all their replicas ready; "
        "environment lookup: 1 of 2 replicas ready, "
        "pod lookup-a container environment: CrashLoopBackOff: back-off 10s; "
        "environment sandbox: 0 of 1 replicas ready, pod sandbox-x: Unschedulable: "
        "0/5 nodes are available: 1 Insufficient cpu, 4 node(s) had untolerated taint.",
    )


@pytest.mark.parametrize(
    "reason", ["ErrImagePull", "ImagePullBackOff", "CrashLoopBackOff", "CreateContainerConfigError"]
)
def test_a_container_that_cannot_start_names_the_environment_the_pod_and_the_kubelets_reason(
    reason: str,
) -> None:
    pods = [waiting("lookup", "lookup-a", reason, "the kubelet's words")]
    failing = condition(Observed(None, pods, deployments=[deployment("lookup", ready=0)]))
    assert failing is not None
    assert (failing.status, failing.reason, failing.message) == (
        "False",
        "PodsFailing",
        "0/1 environments have all their replicas ready; environment lookup: 0 of 1 replicas "
        f"ready, pod lookup-a container environment: {reason}: the kubelet's words",
    )


def test_an_environments_pods_are_its_own_and_not_the_pools() -> None:
    crashing = waiting("sandbox", "sandbox-x", "CrashLoopBackOff")
    both = [deployment("lookup", 2, 2), deployment("sandbox", 1, 0)]
    observed = Observed(None, [crashing], deployments=both)
    status = compute_status(TWO, 2, observed, RLHFJobStatus(), T0)
    reasons = {c.type: c.reason for c in status.conditions}
    assert reasons["PoolsReady"] == "PoolsNotReady"  # the Ray pods are merely not there yet
    assert reasons["EnvironmentsReady"] == "PodsFailing"
    envs = next(c for c in status.conditions if c.type == "EnvironmentsReady")
    assert "environment lookup" not in envs.message


def test_a_pool_and_an_environment_both_unschedulable_are_two_warnings() -> None:
    pool_pod = unschedulable("lookup", "policy-x", "0/5 nodes are available")
    pool_pod["metadata"]["labels"] = {"rlhf.dev/pool": "policy"}
    pods = [pool_pod, unschedulable("lookup", "lookup-a", "0/5 nodes are available")]
    status = compute_status(SPEC, 2, Observed(None, pods), RLHFJobStatus(), T0)
    assert sorted(warnings(status)) == [
        ("EnvironmentsReady", "Unschedulable"),
        ("PoolsReady", "Unschedulable"),
    ]


def test_a_finished_jobs_environments_are_scaled_to_0_and_say_so() -> None:
    from rlhf_operator.api.job import Phase
    from rlhf_operator.render.children import JobRef
    from rlhf_operator.render.environments import render_stopped_environments

    [stopped] = render_stopped_environments(JobRef("agentic-cluster", "ns", "uid-1"), SPEC)
    assert stopped["kind"] == "Deployment" and stopped["spec"]["replicas"] == 0
    done = RLHFJobStatus(phase=Phase.SUCCEEDED, completion_time=T0)
    running = [deployment("lookup")]  # not yet scaled down: the condition says what is asked
    status = compute_status(SPEC, 2, Observed(None, [], deployments=running), done, T0)
    [ended] = [c for c in status.conditions if c.type == "EnvironmentsReady"]
    assert (ended.status, ended.reason) == ("False", "EnvironmentsStopped")
    assert ended.message == "the job has ended: its environments are scaled to 0"
    assert not warnings(status)
