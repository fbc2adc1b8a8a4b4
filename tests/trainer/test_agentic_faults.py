"""Whole runs that meet faults and go on.

- A multi-turn run whose environment hangs in one session and fails another with an
  HTTP 500 (tests.environments.Unreliable, on an event: its 2nd and 4th sessions).
- A fully-async run whose reward service fails every attempt at some samples (those of
  the prompts that start with "a"), scored as they finish (loop/scores_ahead.py).
- A synchronous run whose reward service is down (its port refuses connections) for a
  whole step, from the end of step 1 to the end of step 2 (on those events).

Each fault is masked, counted and named, and the run trains to its end. The faults of
single episodes against real vLLM are in test_episodes.py, a replica killed
mid-session in tests/unit/test_env_replicas.py, and the reward service's own in
tests/unit/test_reward_service.py; these runs show the loop carries on past them.
"""

from __future__ import annotations

import logging
import math
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest

from rlhf_env.rewards import reward_app_for
from rlhf_env.server import app_for
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.data.tasks import toy_copy
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.worker import free_port
from tests.environments import Unreliable, served
from tests.specs import local_async_job, local_job
from tests.trainer.local_runs import train
from tests.trainer.test_multi_turn_run import STEPS, multi_turn_job

pytestmark = pytest.mark.slow  # two whole runs (about a minute each)

RETRIES = 1  # the reward service's attempts at a sample: 1 + RETRIES


class FailsOnPrompts:
    """The toy copy reward, failing (an HTTP 500) every attempt at a sample whose prompt
    starts with "a"; counts the attempts it failed."""

    def __init__(self) -> None:
        self.failed = 0
        self.lock = threading.Lock()

    def __call__(self, prompt: str, response: str) -> float:
        if prompt.split()[0] == "a":
            with self.lock:
                self.failed += 1
            raise ValueError("the judge is down")
        return toy_copy(prompt, response)


def unreliable_job(environment_url: str, checkpoint_dir: Path) -> JobConfig:
    """test_multi_turn_run's job against Unreliable, colocated and synchronous, with no
    held-out rows (so the faulty sessions are training episodes) and a 1 s limit on
    each environment call."""
    job = multi_turn_job("split", environment_url, checkpoint_dir)
    spec = job.model_dump(by_alias=True, exclude_none=True)
    spec["pools"] = [p for p in spec["pools"] if p["name"] == spec["roles"]["actor"]]
    spec["roles"]["critic"] = spec["roles"]["actor"]
    spec["data"].pop("eval")
    spec["generation"]["multiTurn"]["toolCallTimeoutSeconds"] = 1.0
    return JobConfig.model_validate(spec)


def test_a_run_whose_environment_hangs_and_fails_masks_counts_names_and_goes_on(
    tmp_path: Path,
) -> None:
    with served({"unreliable": app_for(Unreliable)}) as url:
        environment = f"{url}/unreliable"
        trained = train(unreliable_job(environment, tmp_path))
    assert [s.step for s in trained.steps] == list(range(1, STEPS + 1))  # it went on
    # Two episodes cut, masked (not trained on), counted by reason, and named with the
    # call and its error.
    episodes = [e for s in trained.steps if s.episodes for e in s.episodes.episodes]
    assert len(episodes) == STEPS * 8
    cuts = sorted(e.cut or "" for e in episodes if e.cut is not None)
    step_at = f"environment step at {environment}"
    assert cuts[0].startswith(f"environment_error: {step_at}"), cuts
    assert "HTTP 500" in cuts[0] and "the tool broke" in cuts[0], cuts
    assert cuts[1].startswith(f"environment_timeout: {step_at}"), cuts
    assert "no answer within 1 s" in cuts[1] and len(cuts) == 2, cuts
    for reason in ("environment_error", "environment_timeout"):
        cut_metric = trained.metrics.registry.get_sample_value(
            "rlhf_env_cut_episodes_total", {"environment": "chatter", "reason": reason}
        )
        assert cut_metric == 1, reason
    # The job's status is told each step's share of cut episodes (status.training.cutRatio).
    told = {progress.step: progress.cut_ratio for progress, _ in trained.reports}
    cut_per_step = {s.step: sum(e.cut is not None for e in s.episodes.episodes) / 8
                    for s in trained.steps if s.episodes}  # fmt: skip
    assert told == cut_per_step and sum(told.values()) == 2 / 8, told


def test_a_run_whose_reward_service_fails_some_samples_masks_counts_names_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reward = FailsOnPrompts()
    with served({"reward": reward_app_for(reward)}) as url, caplog.at_level(logging.WARNING):
        config = local_async_job(
            staleness=1, total_steps=STEPS, checkpoint_dir=tmp_path, every_steps=STEPS
        )
        spec = config.model_dump(by_alias=True, exclude_none=True)
        spec["models"]["reward"] = {
            "url": f"{url}/reward",
            # one sample a request, so a failed request is one sample
            "requests": {"batchSize": 1, "retries": RETRIES, "maxUnscoredSteps": STEPS + 1},
        }
        trained = train(JobConfig.model_validate(spec))
    assert [s.step for s in trained.steps] == list(range(1, STEPS + 1))  # it went on
    # Each failed sample's every attempt failed; those trained on are masked, counted
    # and named (the held-out ones count as reward 0, and the log says so too).
    unscored = sum(s.unscored for s in trained.steps)
    assert unscored > 0
    assert reward.failed % (1 + RETRIES) == 0 and reward.failed // (1 + RETRIES) >= unscored
    metric = trained.metrics.registry.get_sample_value("rlhf_reward_unscored_samples_total")
    assert metric == unscored
    assert f"reward service at {url}/reward/score failed" in caplog.text
    assert "the judge is down" in caplog.text


def test_a_run_whose_reward_service_is_down_for_a_step_masks_it_counts_names_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    reward = {"reward": reward_app_for(toy_copy)}
    service = ExitStack()
    url = service.enter_context(served(reward, port))

    def outage(step: StepResult) -> None:
        if step.step == 1:
            service.close()  # down: nothing listens on its port
        elif step.step == 2:
            service.enter_context(served(reward, port))  # back, at the same address

    config = local_job(colocated=True, total_steps=3, checkpoint_dir=tmp_path, every_steps=3)
    spec = config.model_dump(by_alias=True, exclude_none=True)
    spec["models"]["reward"] = {"url": f"{url}/reward", "requests": {"retries": RETRIES}}
    with service, caplog.at_level(logging.WARNING):
        trained = train(JobConfig.model_validate(spec), on_step=outage)
    samples = config.trainer.batch_size * config.generation.samples_per_prompt
    # Step 2 was scored while the service was down: every sample masked, the run went on
    # within maxUnscoredSteps (3 by default), and the steps on either side were scored.
    assert [(s.step, s.unscored) for s in trained.steps] == [(1, 0), (2, samples), (3, 0)]
    # A step with no reward has no mean reward (not 0), and the status leaves it out.
    assert [math.isnan(s.reward_mean) for s in trained.steps] == [False, True, False]
    assert {p.reward_mean is None for p, _ in trained.reports if p.step == 2} == {True}
    metric = trained.metrics.registry.get_sample_value("rlhf_reward_unscored_samples_total")
    assert metric == samples
    assert f"reward service at {url}/reward/score failed: ConnectError" in caplog.text
    assert all(math.isfinite(s.actor.policy_loss) for s in trained.steps)
