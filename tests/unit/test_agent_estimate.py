"""The memory and time estimates of an agent job count every sample an episode may train
(rows x generation.agent.maxSamplesPerEpisode), other jobs their rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.estimate import CostProfile, alone_seconds
from rlhf_trainer.api.memory import memory_plan, trained_rows
from rlhf_trainer.api.plan import Phase, plan_placement

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"


def agent_job(max_samples: int | None) -> JobConfig:
    """examples/agentic-tools.yaml with an agent in place of its environment (None: as
    it is, multi-turn)."""
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())["spec"]
    if max_samples is not None:
        del spec["environments"]
        spec["agents"] = [{"name": "a", "serve": "m:run"}]
        agent = {"agent": "a", "maxSamplesPerEpisode": max_samples}
        spec["generation"] = {"samplesPerPrompt": 8, "agent": agent}
    return JobConfig.model_validate(spec)


def scoring_bytes(config: JobConfig) -> int:
    (pool,) = memory_plan(config)
    actor = next(role for role in pool.roles if role.role is Role.ACTOR)
    return actor.activation_bytes


def test_an_agent_job_counts_rows_times_its_samples_per_episode() -> None:
    multi_turn, one, four = agent_job(None), agent_job(1), agent_job(4)
    assert trained_rows(multi_turn) == multi_turn.samples_per_step
    assert trained_rows(one) == one.samples_per_step
    assert trained_rows(four) == 4 * four.samples_per_step
    assert scoring_bytes(four) > scoring_bytes(one)


def test_the_time_estimate_scores_and_trains_every_sample() -> None:
    profile = CostProfile.model_validate(
        {
            "source": "this test",
            "promptTokens": 100,
            "responseTokens": 100,
            "generateTokensPerSecond": 1000,
            "forwardTokensPerSecond": 1000,
            "trainTokensPerSecond": 1000,
            "modelGigabytes": 1,
            "weightSyncGigabytesPerSecond": 1,
        }
    )
    one, four = agent_job(1), agent_job(4)
    seconds = [alone_seconds(c, profile, plan_placement(c)) for c in (one, four)]
    assert seconds[1][Phase.ACTOR_LOG_PROB] == 4 * seconds[0][Phase.ACTOR_LOG_PROB]
    assert seconds[1][Phase.GENERATE] == seconds[0][Phase.GENERATE]  # an episode a row
