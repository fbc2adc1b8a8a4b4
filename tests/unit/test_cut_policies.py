"""A cut policy per reason (generation.multiTurn.cuts, issue 72): the policy's own
overruns (maxTurns, the token budget, a turn's timeout) are trained on with a score of
0 unless the spec says otherwise, faults of the environment, the template or the parser
masked; a policy reaches the episodes and is validated naming its field. And per-turn
rewards (Step.reward) ride with the episode, at each turn's last sampled token. Whole
episodes run through EpisodeRunner against a real environment server, with a scripted
engine and Qwen2.5's template."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_env.protocol import Message, Start, Step
from rlhf_env.replicas import EnvironmentReplicas
from rlhf_env.server import app_for
from rlhf_operator.api.validation import parse_job
from rlhf_trainer.algo.experience import Rollout, TurnReward
from rlhf_trainer.api.cuts import CUT_REASONS, TRAINED_BY_DEFAULT, CutPolicies, CutPolicy
from rlhf_trainer.rollout.chat_template import ChatRenderer
from rlhf_trainer.rollout.episodes import EpisodeLimits, EpisodeRunner
from rlhf_trainer.rollout.samples import Sample
from tests.chat_families import HERMES_CALL, LOOKUP, qwen, template_text, tokenizer_of
from tests.environments import served
from tests.unit.celcheck import assert_refused, cel_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"
FIELD = "spec.generation.multiTurn"
TURN_REWARD = 0.25  # what the environment gives each tool call


class Looks:
    """Answers every tool call with a reward of TURN_REWARD, and ends the episode at an
    answer with no call (score 1 for "green"): an engine that always calls never ends."""

    def reset(self, row: dict[str, Any]) -> Start:
        self.answer = ""
        return Start(messages=[Message(role="user", content="The value of 'lime'?")],
                     tools=[LOOKUP])  # fmt: skip

    def step(self, message: Message) -> Step:
        if not message.tool_calls:
            self.answer = (message.content or "").strip()
            return Step(messages=[], done=True)
        answer = Message(role="tool", tool_call_id=message.tool_calls[0].id, content="green")
        return Step(messages=[answer], reward=TURN_REWARD)

    def score(self) -> float:
        return 1.0 if self.answer == "green" else 0.0


def renderer() -> ChatRenderer:
    return ChatRenderer(tokenizer_of(qwen(template="qwen2_5")), "qwen2.5",
                        template=template_text("qwen2_5"))  # fmt: skip


LIMITS = EpisodeLimits(max_turns=2, max_tokens=4096, turn_tokens=64, call_seconds=10,
                       turn_seconds=10, episode_seconds=30)  # fmt: skip


def play(texts: list[str], limits: EpisodeLimits = LIMITS) -> Rollout:
    """One episode whose engine says `texts`, turn after turn."""
    chat = renderer()
    eot = [chat.end_of_turn_id]
    turns = [chat.tokenizer.encode(text, add_special_tokens=False) + eot for text in texts]

    async def engine(prompt: list[int], max_tokens: int) -> Rollout:
        ids = turns.pop(0)[:max_tokens]
        return Rollout(prompt, ids, [-0.5] * len(ids), ids[-1] in eot, 0)

    async def episode() -> Rollout:
        with served({"looks": app_for(Looks)}) as url:
            replicas = EnvironmentReplicas(f"{url}/looks")
            try:
                return await EpisodeRunner(replicas, chat, "hermes", limits).run({}, engine, 0)
            finally:
                await replicas.aclose()

    return asyncio.run(episode())


def turn_ends(loss_mask: tuple[int, ...]) -> list[int]:
    """The index of each sampled run's last token."""
    ends = [*loss_mask, 0]
    return [i for i in range(len(loss_mask)) if ends[i] and not ends[i + 1]]


def test_a_loop_cut_at_max_turns_is_trained_on_with_score_0_by_default() -> None:
    rollout = play([HERMES_CALL, HERMES_CALL])
    episode = rollout.episode
    assert episode is not None and episode.cut == "max_turns" and episode.turns == 2
    assert episode.score == 0.0
    # Its sampled turns are counted: two runs of ones, the tool's answer between them 0.
    assert len(turn_ends(rollout.loss_mask)) == 2 and 0 in rollout.loss_mask
    assert not rollout.finished


def test_a_policy_masks_or_scores_a_cut() -> None:
    masked = play([HERMES_CALL, HERMES_CALL],
                  replace(LIMITS, cuts=CutPolicies(max_turns=CutPolicy(policy="mask"))))  # fmt: skip
    assert masked.episode is not None and masked.episode.cut == "max_turns"
    assert set(masked.loss_mask) == {0} and masked.episode.score == 0.0

    penalty = CutPolicies(max_turns=CutPolicy(policy="train", score=-1.0))
    scored = play([HERMES_CALL, HERMES_CALL], replace(LIMITS, cuts=penalty))
    assert scored.episode is not None and scored.episode.score == -1.0
    assert len(turn_ends(scored.loss_mask)) == 2


def test_each_turns_reward_rides_at_its_last_sampled_token() -> None:
    rollout = play([HERMES_CALL, "green"])
    episode = rollout.episode
    assert episode is not None and (episode.cut, episode.score, episode.turns) == (None, 1.0, 2)
    first_turn_end = turn_ends(rollout.loss_mask)[0]
    assert episode.turn_rewards == (TurnReward(turn=0, token=first_turn_end, reward=TURN_REWARD),)
    assert rollout.response_token_ids[first_turn_end] == renderer().end_of_turn_id

    looped = play([HERMES_CALL, HERMES_CALL])  # both calls rewarded, then cut
    assert looped.episode is not None
    assert [r.token for r in looped.episode.turn_rewards] == turn_ends(looped.loss_mask)
    assert [r.turn for r in looped.episode.turn_rewards] == [0, 1]


def test_turn_rewards_survive_a_checkpointed_queue() -> None:
    rollout = play([HERMES_CALL, "green"])
    again = Sample.from_json(Sample(uid=1, prompt_index=0, rollout=rollout).to_json())
    assert again.rollout.episode == rollout.episode


@pytest.mark.parametrize("reason", CUT_REASONS)
def test_each_reason_has_its_default_and_its_field(reason: str) -> None:
    assert set(CutPolicies.model_fields) == set(CUT_REASONS)
    policy = CutPolicies().of(f"{reason}: what happened")
    assert policy.trains == (reason in TRAINED_BY_DEFAULT)
    assert policy.reward == 0.0
    assert CutPolicies().of("something_new: ...").policy == "mask"  # unknown: never trained


@pytest.fixture
def job() -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["environments"] = [{"name": "lookup", "url": "http://127.0.0.1:9"}]
    return manifest


def test_the_spec_reaches_the_episodes(job: dict[str, Any]) -> None:
    cuts = {"maxTurns": {"policy": "train", "score": -0.5}, "environmentError": {"policy": "train"},
            "tokenBudget": {"policy": "mask"}}  # fmt: skip
    job["spec"]["generation"]["multiTurn"].update(cuts=cuts, turnRewardDiscount=0.9)
    assert cel_errors(job) == []
    config = parse_job(job).spec.job_config()
    assert config.multi_turn is not None and config.multi_turn.turn_reward_discount == 0.9
    limits = EpisodeLimits.of(config)
    assert limits.cuts.of("max_turns").reward == -0.5
    assert limits.cuts.of("environment_error: HTTP 500").trains
    assert not limits.cuts.of("token_budget").trains
    assert limits.cuts.of("turn_timeout").trains  # unset: its default


@pytest.mark.parametrize(
    ("cuts", "path", "words", "cel_too"),
    [
        ({"environmentError": {"policy": "mask", "score": 1.0}}, "cuts.environmentError.score",
         "set it only with policy train", True),
        ({"maxTurns": {"policy": "penalise"}}, "cuts.maxTurns.policy", "'mask' or 'train'", False),
        ({"maxTurns": {"score": -1.0}}, "cuts.maxTurns.policy", "required field is missing",
         False),
        ({"maxTurn": {"policy": "mask"}}, "cuts.maxTurn", "unknown field", False),
    ],
)  # fmt: skip
def test_a_bad_policy_is_refused_naming_its_field(
    job: dict[str, Any], cuts: dict[str, Any], path: str, words: str, cel_too: bool
) -> None:
    job["spec"]["generation"]["multiTurn"]["cuts"] = cuts
    assert_refused(job, f"{FIELD}.{path}", words, cel_too)
