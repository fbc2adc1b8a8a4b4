"""The agentic example (examples/agentic-cluster.yaml) on the real node: a multi-turn,
tool-using job whose environment runs as the job's own service, from the environment
image, in two replicas behind the headless Service the operator renders. The trainer
finds the replicas through the cluster's DNS (no stand-in here), spreads its sessions
over them, and trains a few steps to Succeeded.

While it trains (on an event: the first step reported), one replica is deleted at once,
as with a lost node, and the job goes on to the end. Whether a session was live on it at
that moment is up to the kill's timing, so a session started again elsewhere is proven
on its own event in tests/unit/test_env_replicas.py; here the claim is that the run
survives it.

Kept small for CI, a variant of the example in exactly three ways (small_job): one pool
(the value pool goes, and the critic moves onto the policy pool), the environment in two
replicas, four steps. The example as written fits `make cluster`'s node, a second
replica too (tests/unit/test_example_fits.py). One job (module fixture); the tests read
what it left."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from .harness import REPO_ROOT, ControlPlane
from .jobs import Polled, job_status, poll_to_the_end, real_node_job
from .util import eventually, get_json

pytestmark = pytest.mark.slow  # the images, Ray pods, vLLM and two environment pods: minutes

NAMESPACE = "agentic"
EXAMPLE = yaml.safe_load((REPO_ROOT / "examples" / "agentic-cluster.yaml").read_text())
JOB = EXAMPLE["metadata"]["name"]
STEPS = 4
REPLICAS = 2
ENVIRONMENT = EXAMPLE["spec"]["environments"][0]["name"]
SESSION_STARTED = re.compile(r"session \S+ started")  # rlhf_env.server's line


def small_job() -> dict[str, Any]:
    """The example, as CI can afford it on 2 cores: its one environment in two replicas,
    every role on the policy pool, four steps."""
    job = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    spec = job["spec"]
    spec["pools"] = [p for p in spec["pools"] if p["name"] == "policy"]
    spec["roles"]["critic"] = "policy"
    spec["environments"][0]["replicas"] = REPLICAS
    spec["trainer"]["totalSteps"] = STEPS
    return job


@dataclass
class Run(Polled):
    sessions_before_kill: dict[str, int] = field(default_factory=dict)  # pod -> sessions
    deleted: str = ""
    step_at_the_kill: int = 0
    deployment: dict[str, Any] = field(default_factory=dict)  # the environment's, at the end


def environment_pods(cp: ControlPlane) -> list[dict[str, Any]]:
    selector = f"rlhf.dev/job={JOB},rlhf.dev/environment={ENVIRONMENT}"
    pods: list[dict[str, Any]] = get_json(cp, "pods", "-n", NAMESPACE, "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def sessions_started(cp: ControlPlane, pod: str) -> int:
    logs = cp.kubectl("logs", "-n", NAMESPACE, pod, check=False).stdout
    return len(SESSION_STARTED.findall(logs))


@pytest.fixture(scope="module")
def run(controlplane: ControlPlane) -> Iterator[Run]:
    cp = controlplane
    result = Run()

    def at_first_step(status: dict[str, Any]) -> None:
        """The sessions each replica started so far, then one replica deleted at once."""
        result.step_at_the_kill = status["training"]["step"]  # or fewer: read before it
        pods = environment_pods(cp)
        result.sessions_before_kill = {
            p["metadata"]["name"]: sessions_started(cp, p["metadata"]["name"]) for p in pods
        }
        result.deleted = pods[0]["metadata"]["name"]
        cp.kubectl("delete", "pod", "-n", NAMESPACE, result.deleted,
                   "--grace-period=0", "--force", "--wait=false")  # fmt: skip

    with real_node_job(cp, NAMESPACE, small_job(), "agentic-operator") as job:
        poll_to_the_end(cp, job, NAMESPACE, result, at_first_step)
        # A finished job's environments are stopped (scaled to none): nothing runs on.
        eventually(lambda: not environment_pods(cp), "the environment stopped with the job", 120)
        result.status = job_status(cp, job, NAMESPACE)
        result.deployment = get_json(cp, "deployment", "-n", NAMESPACE, f"{job}-env-{ENVIRONMENT}")
        yield result


def test_the_multi_turn_job_trains_to_succeeded_on_the_real_node(run: Run) -> None:
    assert run.status["phase"] == "Succeeded", run.status
    training = run.status["training"]
    assert training["step"] == training["totalSteps"] == STEPS, training
    # Its episodes had turns: the assistant called the tool and read what came back.
    assert training["turnsMean"] >= 1, training
    ready = {c["type"]: c["status"] for c in run.conditions_at_first_step}
    assert ready.get("EnvironmentsReady") == "True", run.conditions_at_first_step


def test_sessions_spread_over_the_replicas_the_services_dns_names(run: Run) -> None:
    """Both replicas served sessions before the kill: the trainer took their addresses
    from the headless Service's DNS answer."""
    assert len(run.sessions_before_kill) == REPLICAS, run.sessions_before_kill
    assert all(n >= 1 for n in run.sessions_before_kill.values()), run.sessions_before_kill


def test_a_replica_deleted_mid_run_costs_nothing_and_the_environment_stops_with_the_job(
    run: Run,
) -> None:
    """The replica went while steps were still to come, and the job trained them all
    (test_the_multi_turn_job_trains_to_succeeded_on_the_real_node). At the end the
    environment's Deployment is scaled to none, and it has no pods."""
    assert run.deleted in run.sessions_before_kill
    assert 1 <= run.step_at_the_kill < STEPS, run.step_at_the_kill  # steps still to come
    assert run.status["phase"] == "Succeeded"
    assert run.deployment["spec"]["replicas"] == 0, run.deployment["spec"]
    stopped = [c for c in run.status["conditions"] if c["type"] == "EnvironmentsReady"]
    assert [(c["status"], c["reason"]) for c in stopped] == [("False", "EnvironmentsStopped")]
