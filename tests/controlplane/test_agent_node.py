"""An agent that owns its loop, trained on the real node (issue 75): the example
examples/agents/letters-cluster.yaml, whose agent (examples/agents/letters_agent.py,
written only against the `openai` package) runs as the job's own pod from the
environment image. For each episode the trainer POSTs the row to the agent's headless
Service; the agent calls the policy through the gateway of the rollout pool's Ray pod
(port 8100), over the pod network and the cluster's DNS, and returns its grade. The job
trains a few steps to Succeeded.

What proves the steps ran on agent episodes is the driver's own count, rlhf_agent_*
on its metrics port, read from the head pod while the job runs (each poll keeps the
last reading; the head goes with the job). The reward rises: the example's random
policy earns ~0.01 at its first step, and the calls it learns to make earn 0.25 rungs
(0.17-0.20 at steps 19-25 on this node, 2026-12-06; 0.23-0.25 from step 18 in a local
run). STEPS steps take about a minute and a half here: the set-up is most of the test.
One job (module fixture); the tests read what it left. Its images and fixtures are
test_agentic_node.py's."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rlhf_operator.render.children import TRAINER_METRICS_PORT

from . import demo
from .harness import REPO_ROOT, ControlPlane
from .jobs import Polled, poll_to_the_end, real_node_job
from .util import get_json

pytestmark = pytest.mark.slow  # the images, Ray pods, vLLM and the agent's pod: minutes

NAMESPACE = "agents"
EXAMPLE = yaml.safe_load((REPO_ROOT / "examples/agents/letters-cluster.yaml").read_text())
JOB = EXAMPLE["metadata"]["name"]
SPEC = EXAMPLE["spec"]
STEPS = 25
EPISODES_A_STEP = SPEC["trainer"]["batchSize"] * SPEC["generation"]["samplesPerPrompt"]
AGENT = SPEC["agents"][0]["name"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value


def small_job() -> dict[str, Any]:
    job = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    job["spec"]["trainer"]["totalSteps"] = STEPS
    return job


@dataclass
class Run(Polled):
    metrics: Samples = field(default_factory=dict)  # the driver's, last read
    agent_pods: list[dict[str, Any]] = field(default_factory=list)  # while it ran
    rewards: dict[int, float] = field(default_factory=dict)  # step -> rewardMean, as seen

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def driver_metrics(cp: ControlPlane, status: dict[str, Any]) -> Samples:
    """The driver's rlhf_agent_* and rlhf_samples_trained on the head pod's metrics
    port (from this machine: root's connections are not the pods' to refuse), or {}
    while there is no head to ask."""
    head = status.get("rayHead")
    if not head:
        return {}
    by_name = f"metadata.name={head}"
    pods = get_json(cp, "pods", "-n", NAMESPACE, "--field-selector", by_name)["items"]
    ip = pods[0]["status"].get("podIP") if pods else None
    if not ip:
        return {}
    try:
        with urllib.request.urlopen(f"http://{ip}:{TRAINER_METRICS_PORT}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(("rlhf_agent_", "rlhf_samples_trained"))
    }


def agent_pods(cp: ControlPlane) -> list[dict[str, Any]]:
    selector = f"rlhf.dev/job={JOB},rlhf.dev/agent={AGENT}"
    pods: list[dict[str, Any]] = get_json(cp, "pods", "-n", NAMESPACE, "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


@pytest.fixture(scope="module")
def run(controlplane: ControlPlane) -> Iterator[Run]:
    cp = controlplane
    result = Run()

    def each_poll(status: dict[str, Any]) -> None:
        """Its step's reward recorded, and once steps are reported the driver's counts
        (the last reading kept: the head goes with the job)."""
        training = status.get("training") or {}
        if training.get("step") and "rewardMean" in training:
            result.rewards.setdefault(int(training["step"]), float(training["rewardMean"]))
        if training:
            result.metrics = driver_metrics(cp, status) or result.metrics

    def at_first_step(_: dict[str, Any]) -> None:
        result.agent_pods = agent_pods(cp)

    with real_node_job(cp, NAMESPACE, small_job(), "agents-operator") as job:
        poll_to_the_end(cp, job, NAMESPACE, result, at_first_step, each_poll)
        yield result


def test_the_agent_job_trains_to_succeeded_on_the_real_node(run: Run) -> None:
    assert run.status["phase"] == "Succeeded", run.status
    training = run.status["training"]
    assert training["step"] == training["totalSteps"] == STEPS, training
    # An agent episode's turns are its calls through the gateway: one or two each, none
    # for a cut one (masked). Few are cut.
    cut = training.get("cutRatio", 0.0)
    assert cut < 0.5 and training["turnsMean"] >= 1 - cut, training
    ready = {c["type"]: c["status"] for c in run.conditions_at_first_step}
    assert ready.get("AgentsReady") == "True", run.conditions_at_first_step
    # The agent ran as the job's own pod, from the environment image.
    (pod,) = run.agent_pods
    (container,) = pod["spec"]["containers"]
    assert container["image"] == demo.IMAGE_NAMES["environment"], container


def test_the_steps_trained_on_the_agents_episodes_counted_by_the_driver(run: Run) -> None:
    """Every step's episodes went through the agent and the gateway: the driver counted
    them (at the last reading, at least a step's), their calls and the tokens sampled."""
    episodes = sum(v for (name, _), v in run.metrics.items() if name == "rlhf_agent_episodes_total")
    done = run.metric("rlhf_agent_episodes_total", outcome="done")
    assert episodes >= EPISODES_A_STEP, run.metrics
    assert done >= EPISODES_A_STEP / 2, run.metrics  # the rest cut (masked), not most
    assert run.metric("rlhf_agent_calls_total") >= done, run.metrics
    assert run.metric("rlhf_agent_tokens_total", kind="sampled") >= done, run.metrics
    # Each episode trains the sample holding its last call at least: a step's samples are
    # as many as its episodes, or more.
    assert run.metric("rlhf_samples_trained_total") >= EPISODES_A_STEP, run.metrics


def test_the_agents_reward_rises(run: Run) -> None:
    """From the random policy's (a call now and then) to the rung of a call made in most
    episodes (0.25 each): the mean of the last five steps' rewards seen, against the
    first step's."""
    steps = sorted(run.rewards)
    assert steps and steps[0] <= 3, run.rewards  # the first step's seen (polled at 2 Hz)
    late = [run.rewards[s] for s in steps if s > STEPS - 5]
    assert late and run.rewards[steps[0]] <= 0.05, run.rewards
    assert sum(late) / len(late) >= 0.1, run.rewards
