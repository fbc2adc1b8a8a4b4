"""Where a step's rewards come from: a reward model's pool, a rule in the driver, a
reward service (`models.reward.url`), or each episode's environment (`Scorer`); and how
many steps in a row a reward service may leave samples unscored."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlhf_env.rewards import RewardClient, RewardServiceFailed, ScoredSample
from rlhf_trainer.algo.experience import Rollout, pack_rollouts
from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import DRIVER, Phase
from rlhf_trainer.api.reward import RewardRequests, RewardSource
from rlhf_trainer.cluster.role_groups import RoleGroups
from rlhf_trainer.cluster.waits import gather
from rlhf_trainer.data.prompts import Prompt
from rlhf_trainer.data.tasks import RewardFunction
from rlhf_trainer.loop.scores_ahead import Keyed, ScoresAhead
from rlhf_trainer.telemetry.timeline import Timeline

if TYPE_CHECKING:
    from rlhf_trainer.cluster.groups import ObjectRef

REWARD_METHOD = "score"  # the reward model's worker method (Phase.REWARD)
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Tokens:
    """What the driver needs of the actor's tokenizer: responses as text, and padding."""

    decode: Decode
    pad_id: int


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


class Scorer:
    """One reward per response, from wherever the job's rewards come from. A reward
    service is sent each sample as it finishes (`offer`, `feed_from`: ScoresAhead), and
    what was not offered (an evaluation's) when it is scored, through the same scorer
    thread: one HTTP client serves the run."""

    def __init__(
        self,
        source: RewardSource,
        rule: RewardFunction | None,
        groups: RoleGroups,
        tokens: Tokens,
        timeline: Timeline,
        ahead: ScoresAhead | None,
        as_they_finish: bool = True,
    ) -> None:
        self.source = source
        self.rule = rule  # the rule-based reward (data.tasks.reward_function), if any
        self.groups = groups
        self.tokens = tokens
        self.timeline = timeline
        self.ahead = ahead  # with a reward service
        # False: offers are ignored, and a step's samples sent when it scores them
        # (the bench's "at the step")
        self.as_they_finish = ahead is not None and as_they_finish
        self.unscored = UnscoredSteps(source)
        self.alone_keys = itertools.count(-1, -1)  # never a sample's key (those are ≥ 0)

    @classmethod
    @contextmanager
    def open(
        cls,
        source: RewardSource,
        rule: RewardFunction | None,
        groups: RoleGroups,
        tokens: Tokens,
        timeline: Timeline,
        as_they_finish: bool = True,
    ) -> Iterator[Scorer]:
        """The scorer, its reward service's scorer thread running until the exit."""
        client = reward_client(source)
        if client is None:
            yield cls(source, rule, groups, tokens, timeline, None)
            return

        def on_scored(start: float, end: float) -> None:
            timeline.record(DRIVER, Role.REWARD, Phase.REWARD, start, end)

        ahead = ScoresAhead(client, on_scored).start()
        try:
            yield cls(source, rule, groups, tokens, timeline, ahead, as_they_finish)
        finally:
            ahead.stop()

    def samples(self, prompts: Sequence[Prompt], rollouts: Sequence[Rollout]) -> list[ScoredSample]:
        """What a reward service is sent for each response."""
        return [
            ScoredSample(prompt=p.text, response=self.tokens.decode(r.response_token_ids),
                         row=p.fields)
            for p, r in zip(prompts, rollouts, strict=True)
        ]  # fmt: skip

    def offer(
        self, keys: Sequence[int], prompts: Sequence[Prompt], rollouts: Sequence[Rollout]
    ) -> None:
        """Samples that finished, to score now (nothing without a service scoring them
        as they finish)."""
        if self.as_they_finish:
            self.send(keys, prompts, rollouts)

    def send(
        self, keys: Sequence[int], prompts: Sequence[Prompt], rollouts: Sequence[Rollout]
    ) -> None:
        assert self.ahead is not None
        self.ahead.offer(list(zip(keys, self.samples(prompts, rollouts), strict=True)))

    def feed_from(self, read: Callable[[], Keyed]) -> None:
        """Also score what `read()` returns, read after read (fully async's queue)."""
        if self.as_they_finish:
            assert self.ahead is not None
            self.ahead.feed_from(read)

    def score(
        self,
        prompts: Sequence[Prompt],
        rollouts: Sequence[Rollout],
        model: list[ObjectRef[Any]] | None,
        keys: Sequence[int] | None = None,
        model_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B,) one reward per response: from the reward model (`model`: its calls), the
        rule here, the reward service (NaN for a sample it failed; with `keys`, offered
        as they finished), or each episode's environment (its score came with it).
        `model_rows` (B,): where each response is in the batch the reward model scored
        (an agent episode's own sample among its others: algo.row_samples); None: the
        same rows."""
        if self.source.environment:
            return torch.tensor([episode_score(r) for r in rollouts])
        if self.ahead is not None:
            if keys is None or not self.as_they_finish:  # not offered (an evaluation's)
                keys = [next(self.alone_keys) for _ in rollouts]
                self.send(keys, prompts, rollouts)
            return self.ahead.take(keys)
        if self.rule is None:
            assert model is not None, "no reward source: the reward model was not asked"
            scores: torch.Tensor = gather(model)
            return scores if model_rows is None else scores[model_rows]
        with self.timeline.span(DRIVER, Role.REWARD, Phase.REWARD):
            responses = [self.tokens.decode(r.response_token_ids) for r in rollouts]
            return torch.tensor(rule_rewards(self.rule, prompts, responses))

    def score_alone(
        self,
        prompts: Sequence[Prompt],
        rollouts: Sequence[Rollout],
        keys: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """(B,) rewards outside the scoring stage (dynamic sampling, evaluations)."""
        model = None
        if self.source.path is not None:  # a reward model
            batch = pack_rollouts(rollouts, self.tokens.pad_id)
            model = self.groups[Role.REWARD].run_sharded(REWARD_METHOD, batch, phase=Phase.REWARD)
        return self.score(prompts, rollouts, model, keys)
