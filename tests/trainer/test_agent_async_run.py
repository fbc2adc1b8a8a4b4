"""test_agent_run's job in fully async mode: the rollout on a pool of its own, streaming
each agent episode's row into the queue as it ends. An even episode summarises its
history, so its row carries a second sample (Rollout.others) through the queue; every
sample of the finished episodes is trained on, and the one cut episode's are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlhf_trainer.api.config import JobConfig
from tests.trainer.test_agent_run import agent_job, value

pytestmark = pytest.mark.slow  # a whole run

STEPS = 2
ROWS = STEPS * 8  # batchSize 4 x samplesPerPrompt 2 a step


def async_agent_job(checkpoint_dir: Path) -> JobConfig:
    """agent_job, fully async at staleness 0 (a batch ahead at most), the rollout on its
    own simulated GPU."""
    spec = agent_job(checkpoint_dir).model_dump(by_alias=True, exclude_none=True)
    spec["pools"].append({"name": "rollout", "replicas": 1, "gpusPerNode": 1})
    spec["roles"]["rollout"] = "rollout"
    spec["async"] = {"stalenessThreshold": 0.0, "triggerParameterSyncStep": 1}
    return JobConfig.model_validate(spec)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlhf_trainer.cluster.local import local_environments
    from tests.trainer.local_runs import train

    config = async_agent_job(tmp_path_factory.mktemp("agent-async") / "checkpoints")
    with local_environments(config) as served:
        return train(served)


def test_fully_async_trains_every_sample_of_an_agents_episodes(trained: Any) -> None:
    assert [s.step for s in trained.steps] == list(range(1, STEPS + 1))
    rows = sum(len(step.episodes.episodes) for step in trained.steps)
    assert rows == ROWS
    # The agent's even episodes summarise: their rows carry a second sample each. The
    # queue may hold episodes the run never trains, so count those trained: at least the
    # summarising ones among them (about half) gave two samples.
    samples = sum(step.samples for step in trained.steps)
    done = [e for step in trained.steps for e in step.episodes.episodes if e.cut is None]
    assert samples > rows and samples - rows <= len(done)
    assert value(trained, "rlhf_agent_samples_left_out_total") == 0
    assert all(step.response_tokens > 0 for step in trained.steps)
