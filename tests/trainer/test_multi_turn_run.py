"""A whole multi-turn job: PPO with a critic, split and fully async, on a simulated Ray
cluster with real vLLM, against a real environment server.

Every episode has three turns (tests/environments.Chatter) with the environment's
message between them, so every sample the trainer packs has tool-side tokens in its
middle. The check that holds it all together is the engine's log-probs against the
actor's: on every step the actor, recomputing log π over each packed multi-turn sample,
gets the engine's value at every sampled token. A token out of place, a mask that
counts an environment token or drops a sampled one, would break it. A real Prometheus
scrapes each run, and the training dashboard's multi-turn panels must show it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from monitoring.dashboards import TRAINING
from rlhf_env.server import app_for
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.telemetry.metrics import TrainerMetrics, serve_metrics
from tests.conftest import skip_or_fail
from tests.controlplane.processes import free_ports
from tests.environments import CHATTER_TURNS, Chatter, served
from tests.prometheus import BINARY, Prometheus, Target
from tests.specs import LOCAL_EXAMPLE
from tests.trainer.local_runs import Trained, train

pytestmark = pytest.mark.slow  # a whole run (about two minutes)

STEPS = 3
LOG_PROB_TOLERANCE = 1e-4  # fp32 kernels of vLLM and torch (test_ppo_loop's, measured 1e-6)


def multi_turn_job(mode: str, url: str, checkpoint_dir: Path) -> JobConfig:
    """The local example on toy:lookup's rows in Chatter's episodes: split (the critic on
    a pool of its own), or fully async at staleness 0 (the rollout on a pool of its
    own: every episode sampled by the weights it is trained against)."""
    spec = yaml.safe_load(LOCAL_EXAMPLE.read_text())["spec"]
    if mode == "async":
        spec["pools"][1]["name"] = spec["roles"]["rollout"] = "rollout"
        spec["roles"]["critic"] = spec["roles"]["actor"]
        spec["async"] = {"stalenessThreshold": 0}
    spec["algorithm"].pop("klController", None)
    spec["models"]["reward"] = {"environment": True}
    spec["environments"] = [{"name": "chatter", "url": url}]
    spec["generation"]["multiTurn"] = {
        "environment": "chatter",
        "toolParser": "rlhf_toy",
        "maxTurns": CHATTER_TURNS,
        "maxTokens": 48,
    }
    spec["data"] = {
        "train": "toy:lookup",
        "eval": "toy:lookup:heldout",
        "maxPromptLength": 8,
        "maxResponseLength": 4,
    }
    spec["trainer"].update(totalSteps=STEPS, batchSize=8, miniBatchSize=8, evalEverySteps=None)
    spec["trainer"]["checkpoint"] = {"path": str(checkpoint_dir), "everySteps": STEPS}
    return JobConfig.model_validate(spec)


@dataclass
class MultiTurnRun:
    trained: Trained
    prometheus: Prometheus | None  # None where no Prometheus is built


@pytest.fixture(scope="module", params=["split", "async"])
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiTurnRun]:
    """The run, its metrics scraped by a real Prometheus while it trains (as a job's
    driver pod is), and served on after it ends, as the dashboards test's runs are."""
    tmp = tmp_path_factory.mktemp(request.param)
    with served({"chatter": app_for(Chatter)}) as url:
        config = multi_turn_job(request.param, f"{url}/chatter", tmp / "checkpoints")
        metrics = TrainerMetrics(pools=[p.name for p in config.pools])
        if not BINARY.exists():
            yield MultiTurnRun(train(config, metrics), None)
            return
        [port] = free_ports(1)
        server = serve_metrics(metrics.registry, port, addr="127.0.0.1")
        target = Target(port, {"namespace": "local", "rlhfjob": request.param})
        try:
            with Prometheus(tmp, [target]) as prometheus:
                trained = train(config, metrics)
                episodes = STEPS * config.samples_per_step
                prometheus.wait_for(f"rlhf_env_episodes_total == {episodes}")
                yield MultiTurnRun(trained, prometheus)
        finally:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def trained(run: MultiTurnRun) -> Trained:
    return run.trained


def test_the_dashboards_multi_turn_panels_show_the_run_on_prometheus(run: MultiTurnRun) -> None:
    if run.prometheus is None:
        skip_or_fail("no Prometheus: run make controlplane")
    assert run.prometheus is not None
    assert [r.title for r in TRAINING.rows if r.multi_turn] == ["Multi-turn episodes"]
    assert run.prometheus.panels_without_data(TRAINING, multi_turn=True) == {}


def test_every_step_trains_whole_episodes_with_the_engines_log_probs(trained: Trained) -> None:
    assert [s.step for s in trained.steps] == list(range(1, STEPS + 1))
    for step in trained.steps:
        assert step.episodes is not None
        cuts = [e.cut for e in step.episodes.episodes if e.cut]  # named, should one be cut
        assert (step.episodes.turns_mean, step.episodes.cut_ratio, cuts) == (CHATTER_TURNS, 0.0, [])
        assert step.rollout_log_prob_diff < LOG_PROB_TOLERANCE, step
        assert step.critic is not None  # PPO with its critic, over the masked tokens
        # Only the sampled tokens count: at most maxResponseLength per turn.
        assert 0 < step.response_tokens <= 8 * CHATTER_TURNS * 4


def test_the_trace_shows_every_episodes_turns_and_tool_calls(trained: Trained) -> None:
    events = trained.trace["traceEvents"]
    lanes = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and
             e["name"] == "thread_name" and e["args"]["name"].startswith("episodes ")}  # fmt: skip
    phases = [e["name"] for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) in lanes]
    episodes = [e for step in trained.steps if step.episodes for e in step.episodes.episodes]
    assert lanes and phases.count("environment start") == len(episodes)
    for turn in range(1, CHATTER_TURNS + 1):  # each turn, then the environment's answer
        assert phases.count(f"turn {turn}") == len(episodes)
        assert sum(p.startswith(f"tools {turn} (") for p in phases) == len(episodes)


def test_the_reward_is_the_environments_score(trained: Trained) -> None:
    # Chatter scores the words the model said over its turns; a tiny random model
    # samples ~4 words a turn, never more.
    for step in trained.steps:
        assert 0 < step.reward_mean <= CHATTER_TURNS * 4


def test_the_held_out_rows_are_played_as_episodes(trained: Trained) -> None:
    evaluations = [e for step in trained.steps for e in step.evaluations]
    assert evaluations, "no evaluation reported"
    for evaluation in evaluations:
        assert evaluation.prompts == 8  # toy:lookup:heldout
        assert 0 < evaluation.reward_mean <= CHATTER_TURNS * 4
        # how the episodes went, reported as the training steps' are
        assert evaluation.tool_call_rate is not None and evaluation.cut_ratio == 0, evaluation


def test_the_step_log_counts_turns_and_cuts(
    trained: Trained, caplog: pytest.LogCaptureFixture
) -> None:
    from rlhf_trainer.loop.run import log_step

    with caplog.at_level(logging.INFO):
        log_step(trained.steps[-1], STEPS)
    assert f"turns {CHATTER_TURNS:.2f}, tool calls " in caplog.text
    assert "cut 0.00" in caplog.text
