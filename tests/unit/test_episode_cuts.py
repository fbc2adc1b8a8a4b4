"""Whole episodes (EpisodeRunner, a real environment server, a scripted engine) whose
chat template fails, or whose environment answers more than the budget holds: a
template's error is a cut with its reason, counted like the others, never an exception
out of the episode (a failed step, or a failed run in fully-async mode); a tool result
is cut to multiTurn.maxObservationTokens; no episode's row is wider than its token
budget (multiTurn.maxTokens), whatever the environment sent; and the client reads an
answer only up to its bound.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlhf_env.client import EnvironmentCallFailed, EnvironmentClient
from rlhf_env.protocol import FunctionCall, Message, Start, Step, ToolCall
from rlhf_env.replicas import EnvironmentReplicas
from rlhf_env.server import app_for
from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.rollout.chat_template import ChatRenderer
from rlhf_trainer.rollout.episodes import EpisodeLimits, EpisodeRunner
from rlhf_trainer.rollout.trajectory import UnknownToolParser
from tests.chat_families import (
    GEMMA,
    HERMES_CALL,
    LOOKUP,
    Family,
    qwen,
    template_text,
    tokenizer_of,
)
from tests.environments import served


class Answers:
    """Asks for the value of 'lime'; its tool answers in the role and with the content
    the data row gives (`role`, `content`); the score is 1 for an answer of "green"."""

    def reset(self, row: dict[str, Any]) -> Start:
        self.row, self.answer = row, ""
        question = row.get("question", "What is the value of the key 'lime'?")
        return Start(messages=[Message(role="user", content=question)], tools=[LOOKUP])

    def step(self, message: Message) -> Step:
        if not message.tool_calls:
            self.answer = (message.content or "").strip()
            return Step(messages=[], done=True)
        role, content = self.row.get("role", "tool"), self.row.get("content", "green")
        if role == "tool":
            return Step(messages=[Message(role="tool", tool_call_id=message.tool_calls[0].id,
                                          content=content)])  # fmt: skip
        return Step(messages=[Message(role=role, content=content)])

    def score(self) -> float:
        return 1.0 if self.answer == "green" else 0.0


def gemma2() -> ChatRenderer:
    family = Family("gemma2", "pythonic", GEMMA, "<bos>", "<eos>", "<end_of_turn>", "", pad="<pad>")
    return ChatRenderer(tokenizer_of(family), "gemma2", template=template_text("gemma2"))


def qwen2_5() -> ChatRenderer:
    family = qwen(template="qwen2_5")
    return ChatRenderer(tokenizer_of(family), "qwen2.5", template=template_text("qwen2_5"))


def limits(max_tokens: int, observation_tokens: int | None = None) -> EpisodeLimits:
    return EpisodeLimits(max_turns=4, max_tokens=max_tokens, turn_tokens=64, call_seconds=10,
                         turn_seconds=10, episode_seconds=30,
                         observation_tokens=observation_tokens)  # fmt: skip


def play(
    renderer: ChatRenderer, parser: str, call: str, row: dict[str, Any], limits: EpisodeLimits
) -> Rollout:
    """One episode: the engine (a script) calls lookup, then answers "green"."""
    tokenizer, eot = renderer.tokenizer, [renderer.end_of_turn_id]
    turns = [tokenizer.encode(text, add_special_tokens=False) + eot for text in (call, "green")]

    async def engine(prompt: list[int], max_tokens: int) -> Rollout:
        ids = turns.pop(0)[:max_tokens]
        return Rollout(prompt, ids, [-0.5] * len(ids), ids[-1] in eot, 0)

    async def episode() -> Rollout:
        with served({"answers": app_for(Answers)}) as url:
            replicas = EnvironmentReplicas(f"{url}/answers")
            try:
                return await EpisodeRunner(replicas, renderer, parser, limits).run(row, engine, 0)
            finally:
                await replicas.aclose()

    return asyncio.run(episode())


def width(rollout: Rollout) -> int:
    return len(rollout.prompt_token_ids) + len(rollout.response_token_ids)


def test_a_role_the_template_refuses_cuts_the_episode_with_a_named_reason() -> None:
    """Gemma 2's template has no tool role: a tool result raises in the template. The
    episode is cut, its reason named and counted; the same episode with the answer as
    a user message (which the template takes) is scored."""
    call = '[lookup(key="lime")]'
    rollout = play(gemma2(), "pythonic", call, {"role": "tool"}, limits(512))
    assert rollout.episode is not None and rollout.episode.cut is not None
    assert rollout.episode.cut.startswith(
        "template_error: gemma2: its chat template failed: Conversation roles must alternate"
    )
    assert EpisodeStats((rollout.episode,)).cuts == {"template_error": 1}
    assert not rollout.finished and set(rollout.loss_mask) == {0}
    assert rollout.episode.score == 0.0

    scored = play(gemma2(), "pythonic", call, {"role": "user"}, limits(512))
    assert scored.episode is not None
    assert (scored.episode.cut, scored.episode.score, scored.episode.turns) == (None, 1.0, 2)


def test_each_tool_result_is_cut_to_max_observation_tokens_with_a_marker() -> None:
    renderer = qwen2_5()
    whole = renderer.tokenizer.encode("green " * 400, add_special_tokens=False)
    row = {"content": "green " * 400}
    rollout = play(renderer, "hermes", HERMES_CALL, row, limits(4096, observation_tokens=8))
    assert rollout.episode is not None
    assert (rollout.episode.cut, rollout.episode.score) == (None, 1.0)
    text = renderer.tokenizer.decode(rollout.response_token_ids, skip_special_tokens=False)
    assert f"\n[... {len(whole) - 8} of {len(whole)} tokens cut]\n</tool_response>" in text
    assert text.count("green") < 20  # 8 tokens of the result, then the answer

    unbounded = play(renderer, "hermes", HERMES_CALL, row, limits(4096))
    assert unbounded.episode is not None and unbounded.episode.cut is None
    assert width(unbounded) > width(rollout) + 300


def test_a_cut_episode_keeps_no_trailing_observed_tokens_and_fits_its_budget() -> None:
    """The tool's answer overflows the budget: the episode is cut for it, and its row
    ends with the last sampled turn; without the cut's trimming it would be as wide as
    the prompt, the call and the whole answer."""
    renderer = qwen2_5()
    prompt = len(renderer.prompt_ids([Message(role="user", content="x")], [LOOKUP]))
    budget = prompt + 64
    rollout = play(renderer, "hermes", HERMES_CALL, {"content": "green " * 400}, limits(budget))
    assert rollout.episode is not None and rollout.episode.cut == "token_budget"
    assert width(rollout) <= budget
    call = renderer.tokenizer.encode(HERMES_CALL, add_special_tokens=False)
    assert rollout.response_token_ids == [*call, renderer.end_of_turn_id]


def test_a_prompt_over_the_budget_is_cut_to_it() -> None:
    renderer = qwen2_5()
    row = {"question": "What is the value of the key 'lime'? " * 100}
    rollout = play(renderer, "hermes", HERMES_CALL, row, limits(64))
    assert rollout.episode is not None and rollout.episode.cut == "token_budget"
    assert width(rollout) <= 64


def test_an_answer_over_the_clients_bound_fails_its_call_unread() -> None:
    """The client reads an answer up to max_answer_bytes: a bigger tool result fails the
    step as a protocol error (an episode's `environment_protocol` cut), not memory."""
    call = ToolCall(id="call00000", function=FunctionCall(name="lookup", arguments="{}"))

    async def step(size: int) -> Step:
        with served({"answers": app_for(Answers)}) as url:
            async with EnvironmentClient(f"{url}/answers", max_answer_bytes=64_000) as client:
                started = await client.start({"content": "g" * size})
                try:
                    return await client.step(
                        started.session, Message(role="assistant", tool_calls=[call])
                    )
                finally:
                    await client.close(started.session)

    assert asyncio.run(step(60_000)).messages[0].content == "g" * 60_000
    with pytest.raises(EnvironmentCallFailed, match="its answer is over 64000 bytes") as failed:
        asyncio.run(step(70_000))
    assert failed.value.kind == "protocol"


def test_a_parser_name_vllm_does_not_know_fails_the_runner_not_each_episode() -> None:
    replicas = EnvironmentReplicas("http://127.0.0.1:9")
    with pytest.raises(UnknownToolParser, match=r"'hermez'.*hermes"):
        EpisodeRunner(replicas, qwen2_5(), "hermez", limits(64))
