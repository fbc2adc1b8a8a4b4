"""Who judges an agent episode, and what a cut does, as AgentEpisodeRunner decides it:
with a gateway and an agent that answer as told (no engine, no HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from rlhf_env.agent_protocol import EpisodeRequest, EpisodeResult
from rlhf_env.client import EnvironmentCallFailed
from rlhf_trainer.api.agents import AgentEpisodes
from rlhf_trainer.gateway.records import (
    MAX_CALL_TOKENS,
    MAX_CALLS,
    CallLimits,
    CallRecord,
    EpisodeRecords,
    SampledChoice,
)
from rlhf_trainer.rollout.agent_client import AgentEpisodeFailed
from rlhf_trainer.rollout.agent_episodes import UNJUDGED, AgentEpisode, AgentEpisodeRunner


def calls() -> tuple[CallRecord, ...]:
    """Two calls, the second on an edited history: two samples."""
    choice = SampledChoice(0, [7, 3], [-0.5, -0.5], ((0, 0),), "stop")
    return CallRecord(0, [1, 5, 2], (choice,)), CallRecord(1, [1, 6, 2], (choice,))


class Gateway:
    def __init__(self, cut: str | None = None) -> None:
        self.cut = cut

    def open_episode(self, key: str, limits: CallLimits) -> None:
        pass

    async def close_episode(self, key: str) -> EpisodeRecords:
        refusals = {self.cut: 1} if self.cut is not None else {}
        return EpisodeRecords(calls(), self.cut, refusals)


class Agent:
    def __init__(self, reward: float | None, fails: bool = False) -> None:
        self.reward, self.fails = reward, fails

    async def run(self, request: EpisodeRequest) -> EpisodeResult:
        if self.fails:
            raise AgentEpisodeFailed(EnvironmentCallFailed("episodes", "http://a", "raised", 500))
        return EpisodeResult(reward=self.reward)


def run(
    agent: Agent,
    job_judges: bool,
    gateway: Gateway | None = None,
    cuts: dict[str, Any] | None = None,
) -> AgentEpisode:
    settings = AgentEpisodes.model_validate({"agent": "a", "callDiscount": 0.5, "cuts": cuts or {}})
    runner = AgentEpisodeRunner(
        cast(Any, gateway or Gateway()), "http://gw/v1", cast(Any, agent), settings, job_judges
    )
    return asyncio.run(runner.run({"key": "c"}, "e-0"))


def test_without_a_reward_an_episode_is_cut_when_the_reward_is_the_agents() -> None:
    ended = run(Agent(reward=None), job_judges=False)
    assert ended.cut == UNJUDGED
    row = ended.trained(version=0, max_samples=4)
    assert sum(row.loss_mask) == 0 and row.others == ()


def test_without_a_reward_the_jobs_reward_judges_the_episode() -> None:
    ended = run(Agent(reward=None), job_judges=True)
    assert ended.cut is None
    row = ended.trained(version=0, max_samples=4)
    assert row.loss_mask == (1, 1) and [o.rollout.loss_mask for o in row.others] == [(1, 1)]
    assert [o.share for o in row.others] == [0.5]  # of whatever the job's reward gives


def test_the_agents_reward_is_shared_over_its_samples() -> None:
    row = run(Agent(reward=2.0), job_judges=False).trained(version=0, max_samples=4)
    assert row.episode is not None and row.episode.score == 2.0
    (other,) = row.others
    assert other.rollout.episode is not None and other.rollout.episode.score == 1.0


def test_a_limit_trains_as_its_policy_says_and_an_agents_fault_stays_masked() -> None:
    policy = {"maxCalls": {"policy": "train", "score": -1}}
    trained = run(Agent(reward=3.0), False, Gateway(cut=MAX_CALLS), policy)
    row = trained.trained(version=0, max_samples=4)
    assert trained.cut == MAX_CALLS and row.loss_mask == (1, 1) and len(row.others) == 1
    assert row.episode is not None and row.episode.score == -1.0  # the policy's, not 3
    masked = run(Agent(reward=3.0), False, Gateway(cut=MAX_CALL_TOKENS), policy)
    assert sum(masked.trained(version=0, max_samples=4).loss_mask) == 0  # unset: masked
    failed = run(Agent(reward=None, fails=True), True, cuts=policy)
    assert failed.cut is not None and failed.cut.startswith("agent_error")
    assert sum(failed.trained(version=0, max_samples=4).loss_mask) == 0
