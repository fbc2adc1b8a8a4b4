"""The AgentsReady condition from the agents' Deployments and pods (pure): the same logic
as EnvironmentsReady (controller/environments.py), told apart by the agents' labels."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rlhf_operator.api.job import Condition, Phase, RLHFJobSpec, RLHFJobStatus
from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.environments import Verdict, agents_ready
from rlhf_operator.controller.status import Observed, compute_status, warnings
from tests.unit.conftest import EXAMPLES, load

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def spec_with(*agents: dict[str, Any]) -> RLHFJobSpec:
    """The agentic example, its episodes run by these agents (the first), no environment."""
    job = load(EXAMPLES[0].parent / "agentic-cluster.yaml")
    spec = job["spec"]
    del spec["generation"]["multiTurn"]
    spec |= {"environments": [], "agents": list(agents)}
    spec["generation"]["agent"] = {"agent": agents[0]["name"]}
    spec["models"]["reward"] = {"function": "toy_copy"}
    return parse_job(job).spec


TWO = spec_with(
    {"name": "coder", "serve": "agents.coder:run", "replicas": 2},
    {"name": "bash", "image": "bash-agent:1", "command": ["bash-agent"]},
    {"name": "remote", "url": "http://remote.team.svc:8000"},  # not the operator's to run
)


def deployment(agent: str, replicas: int = 1, ready: int = 1) -> dict[str, Any]:
    return {
        "kind": "Deployment",
        "metadata": {"name": f"agentic-cluster-agent-{agent}", "generation": 1},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"rlhf.dev/job": "j", "rlhf.dev/agent": agent}},
        },
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
        },
    }


def agent_pod(agent: str, name: str, **status: Any) -> dict[str, Any]:
    labels = {"rlhf.dev/job": "j", "app.kubernetes.io/component": "agent", "rlhf.dev/agent": agent}
    return {"metadata": {"name": name, "labels": labels}, "status": {"phase": "Pending", **status}}


def crashing(agent: str, name: str) -> dict[str, Any]:
    state = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}
    return agent_pod(agent, name, containerStatuses=[{"name": "agent", "state": state}])


def conditions(
    spec: RLHFJobSpec, observed: Observed, old: RLHFJobStatus | None = None
) -> dict[str, Condition]:
    status = compute_status(spec, 2, observed, old or RLHFJobStatus(), T0)
    return {c.type: c for c in status.conditions}


def test_a_job_without_agents_the_operator_runs_has_no_such_condition() -> None:
    only_url = spec_with({"name": "remote", "url": "http://remote.team.svc:8000"})
    assert agents_ready(only_url, [], []) is None
    assert "AgentsReady" not in conditions(only_url, Observed(None, []))


def test_every_replica_ready_is_agents_ready() -> None:
    both = [deployment("coder", 2, 2), deployment("bash")]
    assert agents_ready(TWO, both, []) == Verdict(
        True, "AgentsReady", "2/2 agents have all their replicas ready"
    )
    ready = conditions(TWO, Observed(None, [], deployments=both))["AgentsReady"]
    assert (ready.status, ready.reason) == ("True", "AgentsReady")
    # An environment's Deployment is not an agent's, even under the same name.
    environment = deployment("coder", 2, 2)
    environment["spec"]["selector"]["matchLabels"] = {"rlhf.dev/environment": "coder"}
    assert agents_ready(TWO, [environment, deployment("bash")], []) == Verdict(
        False,
        "AgentsNotReady",
        "1/2 agents have all their replicas ready; "
        "agent coder: 0 of 2 replicas ready (no Deployment yet)",
    )


def test_a_crashing_agent_names_itself_its_pod_and_why_and_is_a_warning_not_the_pools() -> None:
    pods = [crashing("bash", "bash-x")]
    found = conditions(
        TWO, Observed(None, pods, deployments=[deployment("coder", 2, 2), deployment("bash", 1, 0)])
    )
    agents = found["AgentsReady"]
    assert (agents.status, agents.reason, agents.message) == (
        "False",
        "PodsFailing",
        "1/2 agents have all their replicas ready; agent bash: 0 of 1 replicas ready, "
        "pod bash-x container agent: CrashLoopBackOff: back-off 10s",
    )
    assert found["PoolsReady"].reason == "PoolsNotReady"  # an agent's pod is not a pool's
    status = compute_status(TWO, 2, Observed(None, pods), RLHFJobStatus(), T0)
    assert ("AgentsReady", "PodsFailing") in warnings(status)


def test_an_unschedulable_agent_says_the_schedulers_words() -> None:
    placed = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
              "message": "0/5 nodes are available: 5 Insufficient cpu."}  # fmt: skip
    pods = [agent_pod("coder", "coder-x", conditions=[placed])]
    verdict = agents_ready(TWO, [deployment("coder", 2, 1), deployment("bash")], pods)
    assert verdict is not None and verdict.reason == "Unschedulable"
    assert verdict.message.endswith(
        "agent coder: 1 of 2 replicas ready, pod coder-x: Unschedulable: "
        "0/5 nodes are available: 5 Insufficient cpu."
    )


def test_a_finished_jobs_agents_are_scaled_to_0_and_say_so() -> None:
    old = RLHFJobStatus(phase=Phase.SUCCEEDED, completion_time=T0)
    agents = conditions(TWO, Observed(None, []), old)["AgentsReady"]
    assert (agents.status, agents.reason, agents.message) == (
        "False",
        "AgentsStopped",
        "the job has ended: its agents are scaled to 0",
    )
