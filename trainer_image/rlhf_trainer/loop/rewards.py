"""Where a step's rewards come from, beside a reward model's pool: a rule in the driver,
a reward service (`models.reward.url`), or each episode's environment; and how many
steps in a row a reward service may leave samples unscored."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf_env.rewards import RewardClient, RewardServiceFailed
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.reward import RewardRequests, RewardSource
from rlhf_trainer.data.prompts import Prompt
from rlhf_trainer.data.tasks import RewardFunction


@dataclass
class UnscoredSteps:
    """Steps in a row with samples the reward left unscored (NaN: the reward service
    failed them); the run fails, naming the reward, once there are
    models.reward.requests.maxUnscoredSteps of them."""

    source: RewardSource
    in_a_row: int = 0

    def count(self, step: int, scores: torch.Tensor) -> int:
        """The step's unscored samples, (B,) scores in."""
        unscored = int(torch.isnan(scores).sum())
        self.in_a_row = self.in_a_row + 1 if unscored else 0
        limit = (self.source.requests or RewardRequests()).max_unscored_steps
        if self.in_a_row >= limit:
            raise RewardServiceFailed(
                self.source.url or "the driver",
                f"step {step}: {self.in_a_row} steps in a row left samples unscored, "
                f"{unscored} of {len(scores)} this one (models.reward.requests."
                f"maxUnscoredSteps is {limit}); the log names each failure",
            )
        return unscored


def reward_client(source: RewardSource) -> RewardClient | None:
    """The client of the reward service that models.reward.url names; None without."""
    if source.url is None:
        return None
    requests = source.requests or RewardRequests()
    return RewardClient(
        source.url,
        timeout=requests.timeout_seconds,
        retries=requests.retries,
        concurrency=requests.concurrency,
        batch_size=requests.batch_size,
    )


def service_rewards(rewards: Sequence[float | None]) -> torch.Tensor:
    """(B,) a reward service's answers, NaN for each sample it failed (unscored)."""
    return torch.tensor([math.nan if r is None else r for r in rewards])


def episode_score(rollout: Rollout) -> float:
    if rollout.episode is None:
        raise ValueError("the reward is the environment's, but a rollout came with no episode")
    return rollout.episode.score


def rule_rewards(
    reward: RewardFunction, prompts: Sequence[Prompt], responses: Sequence[str]
) -> list[float]:
    """A rule-based reward per response, given its prompt's text and dataset columns."""
    return [
        float(reward(p.text, response, **p.fields))
        for p, response in zip(prompts, responses, strict=True)
    ]
