"""A multi-turn trajectory's tokens, with a real chat template and tokenizer
(SmolLM2-135M-Instruct, ChatML) and vLLM's own Hermes tool parser.

The token-exactness tests sample "gr" + "een" where the tokenizer writes "green": a
trainer that decoded the conversation and encoded it again would train on ids the
engine never sampled, and these tests would fail it. The last runs the whole
EpisodeRunner against a real environment server, with a scripted engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlhf_env.protocol import Message, Start, Step, Tool, ToolFunction
from rlhf_env.replicas import EnvironmentReplicas
from rlhf_env.server import app_for
from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.experience import Episode, Rollout
from rlhf_trainer.rollout.episodes import EpisodeLimits, EpisodeRunner
from rlhf_trainer.rollout.trajectory import (
    ChatRenderer,
    TemplateNotIncremental,
    ToolCallParser,
    Trajectory,
    TrajectoryLimits,
    UnknownToolParser,
    limit_before_next_turn,
    template_message,
)
from tests.conftest import needs
from tests.environments import served
from tests.real_model import real_model_dir

pytestmark = needs(
    None
    if (real_model_dir() / "tokenizer.json").exists()
    else f"no SmolLM2 tokenizer at {real_model_dir()} (make real-model)"
)

MODEL = "SmolLM2-135M-Instruct"
LOOKUP = Tool(
    function=ToolFunction(
        name="lookup",
        parameters={"type": "object", "properties": {"key": {"type": "string"}}},
    )
)
CALL_TEXT = '<tool_call>\n{"name": "lookup", "arguments": {"key": "lime"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir())


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> ChatRenderer:
    return ChatRenderer(tokenizer, MODEL)


@pytest.fixture(scope="module")
def hermes(tokenizer: Any) -> ToolCallParser:
    return ToolCallParser("hermes", tokenizer, [LOOKUP])


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def fake_log_probs(ids: list[int], turn: int) -> list[float]:
    """Distinct per position, so a shifted alignment shows."""
    return [-(turn + 1) - index / 100 for index in range(len(ids))]


QUESTION = [Message(role="user", content="What is the value of the key 'lime'?")]


def two_turn_trajectory(
    tokenizer: Any, renderer: ChatRenderer, hermes: ToolCallParser
) -> tuple[Trajectory, list[int], list[int], list[int]]:
    """Turn 0 calls the tool, the environment answers "green", turn 1 says "green"
    sampled as "gr" + "een". Returns the trajectory and the ids of its three parts."""
    prompt_text = renderer.tokenizer.apply_chat_template(
        [template_message(m) for m in QUESTION], tokenize=False, add_generation_prompt=True
    )
    trajectory = Trajectory(prompt_ids=encode(tokenizer, prompt_text))
    eot = [renderer.end_of_turn_id]

    call_ids = encode(tokenizer, CALL_TEXT) + eot
    assistant = hermes.parse(renderer.assistant_text(call_ids), turn=0)
    trajectory.add_sampled(call_ids, fake_log_probs(call_ids, 0), 3, len(assistant.tool_calls))

    answer = [Message(role="tool", tool_call_id=assistant.tool_calls[0].id, content="green")]
    tool_ids = renderer.observation_ids(answer)
    trajectory.add_observed(tool_ids)

    green_ids = encode(tokenizer, "gr") + encode(tokenizer, "een") + eot
    assert encode(tokenizer, "green") != green_ids[:-1], "the drift case must split a merge"
    trajectory.add_sampled(green_ids, fake_log_probs(green_ids, 1), 5)
    return trajectory, call_ids, tool_ids, green_ids


def test_trained_tokens_are_the_sampled_ones_plus_the_tool_tokens(
    tokenizer: Any, renderer: ChatRenderer, hermes: ToolCallParser
) -> None:
    trajectory, call_ids, tool_ids, green_ids = two_turn_trajectory(tokenizer, renderer, hermes)
    prompt = trajectory.prompt_ids
    assert trajectory.token_ids == prompt + call_ids + tool_ids + green_ids

    sampled = [0] * len(prompt) + [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(green_ids)
    assert trajectory.loss_mask == sampled
    log_probs = trajectory.log_probs
    assert len(log_probs) == len(trajectory.token_ids)
    starts = [len(prompt), len(prompt) + len(call_ids) + len(tool_ids)]
    for turn, (start, ids) in enumerate(zip(starts, [call_ids, green_ids], strict=True)):
        assert trajectory.token_ids[start : start + len(ids)] == ids
        assert log_probs[start : start + len(ids)] == fake_log_probs(ids, turn)
    assert all(p == 0.0 for p, m in zip(log_probs, sampled, strict=True) if m == 0)
    assert (trajectory.turns, trajectory.tool_calls, trajectory.versions) == (2, 1, [3, 5])
    assert trajectory.trainable

    # Why the trainer never re-tokenises: the round trip merges "gr" + "een".
    text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    retokenised = encode(tokenizer, text)
    assert retokenised != trajectory.token_ids
    assert len(retokenised) == len(trajectory.token_ids) - 1


def test_the_appended_tokens_read_as_the_template_renders_the_whole_conversation(
    tokenizer: Any, renderer: ChatRenderer, hermes: ToolCallParser
) -> None:
    trajectory, call_ids, _, _ = two_turn_trajectory(tokenizer, renderer, hermes)
    assistant = hermes.parse(renderer.assistant_text(call_ids), turn=0)
    conversation = [
        *QUESTION,
        # SmolLM2's template renders an assistant's content only: the call's text
        Message(role="assistant", content=CALL_TEXT),
        Message(role="tool", tool_call_id=assistant.tool_calls[0].id, content="green"),
        Message(role="assistant", content="green"),
    ]
    whole = tokenizer.apply_chat_template(
        [template_message(m) for m in conversation], tokenize=False
    )
    # The template's "\n" after the last <|im_end|> comes with a next turn, if any.
    assert tokenizer.decode(trajectory.token_ids, skip_special_tokens=False) + "\n" == whole

    # The tool turn alone: the glue after <|im_end|>, the tool message, the next prompt.
    answer = Message(role="tool", tool_call_id="call00000", content="green")
    assert renderer.observation_text([answer]) == (
        "\n<|im_start|>tool\ngreen<|im_end|>\n<|im_start|>assistant\n"
    )
    assert renderer.observation_text([answer], closed=False).startswith("<|im_end|>\n")


# ChatML that drops an assistant turn's content once messages follow it, as templates
# that drop old reasoning do: appending tool results would give a conversation it never
# renders.
DROPPING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}(dropped){% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer, "rewriter", template=DROPPING)
    assert renderer.end_of_turn == "<|im_end|>"  # read from the template
    with pytest.raises(TemplateNotIncremental, match="rewriter"):
        renderer.observation_ids([Message(role="tool", tool_call_id="c", content="x")])
    # The same template, keeping the content, is accepted: the check is not the refusal.
    keeping = DROPPING.replace("(dropped)", "{{ m.content }}")
    text = ChatRenderer(tokenizer, "keeper", template=keeping).observation_text(
        [Message(role="tool", tool_call_id="c", content="x")]
    )
    assert text == "\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n"


def test_hermes_parses_one_call_and_keeps_the_content_before_it(hermes: ToolCallParser) -> None:
    message = hermes.parse("Let me look.\n" + CALL_TEXT, turn=2)
    assert message.role == "assistant"
    assert message.content == "Let me look.\n"
    (call,) = message.tool_calls
    assert (call.id, call.function.name) == ("call00200", "lookup")
    assert call.function.parsed_arguments() == {"key": "lime"}


def test_hermes_parses_two_calls(hermes: ToolCallParser) -> None:
    second = CALL_TEXT.replace("lime", "apple")
    message = hermes.parse(CALL_TEXT + "\n" + second, turn=0)
    assert message.content is None
    assert [c.id for c in message.tool_calls] == ["call00000", "call00001"]
    keys = [c.function.parsed_arguments()["key"] for c in message.tool_calls]
    assert keys == ["lime", "apple"]


def test_plain_content_has_no_calls(hermes: ToolCallParser) -> None:
    message = hermes.parse("green", turn=1)
    assert (message.content, message.tool_calls) == ("green", [])


def test_bad_json_in_a_call_stays_content(hermes: ToolCallParser) -> None:
    text = '<tool_call>\n{"name": "lookup", "arguments": {"key": lime}}\n</tool_call>'
    message = hermes.parse(text, turn=0)  # vLLM logs the JSON error and gives up
    assert (message.content, message.tool_calls) == (text, [])


def test_an_unknown_parser_names_the_known_ones(tokenizer: Any) -> None:
    with pytest.raises(UnknownToolParser, match=r"'hermez'.*hermes"):
        ToolCallParser("hermez", tokenizer, [LOOKUP])


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        (TrajectoryLimits(max_turns=1, max_tokens=10_000), "max_turns"),
        (TrajectoryLimits(max_turns=8, max_tokens=10), "token_budget"),
        (TrajectoryLimits(max_turns=8, max_tokens=10_000), None),
    ],
)
def test_limits_before_the_next_turn(limits: TrajectoryLimits, reason: str | None) -> None:
    trajectory = Trajectory(prompt_ids=[1, 2, 3])
    trajectory.add_sampled([4, 5, 6, 7, 8, 9, 10], [-0.5] * 7, version=0)
    assert limit_before_next_turn(trajectory, limits) == reason


@pytest.mark.parametrize(
    "reason", ["max_turns", "token_budget", "environment_error: HTTP 500: the tool broke"]
)
def test_a_cut_trajectory_is_not_trained_on(reason: str) -> None:
    trajectory = Trajectory(prompt_ids=[1, 2])
    trajectory.add_sampled([3, 4], [-0.1, -0.2], version=0, tool_calls=1)
    trajectory.add_observed([5, 6, 7])
    assert trajectory.trainable and sum(trajectory.loss_mask) == 2
    trajectory.cut_short(reason)
    trajectory.cut_short("a later reason")  # the first stands
    assert not trajectory.trainable
    assert trajectory.cut == reason
    # Its sampled tokens are kept, to be counted and shown; the environment's last
    # answer, after which nothing was sampled, goes (it may be what overflowed).
    assert trajectory.token_ids == [1, 2, 3, 4]
    assert trajectory.loss_mask == [0] * 4
    with pytest.raises(ValueError, match="cut"):
        trajectory.add_sampled([8], [-0.3], version=0)


def test_cuts_are_counted_by_kind() -> None:
    reasons = ["max_turns", "environment_timeout: no answer", "environment_error: HTTP 500", None]
    episodes = [Episode(score=0.0, turns=1, tool_calls=0, version_span=0, cut=r) for r in reasons]
    stats = EpisodeStats(tuple(episodes))
    assert stats.cuts == {"environment_error": 1, "environment_timeout": 1, "max_turns": 1}
    assert stats.cut_ratio == 0.75


def test_version_span_over_turns() -> None:
    trajectory = Trajectory(prompt_ids=[1])
    for version in (3, 3, 5):
        trajectory.add_sampled([2], [-0.1], version)
        trajectory.add_observed([9])
    assert trajectory.versions == [3, 3, 5]
    assert trajectory.version_span == 2
    assert [turn.turn for turn in trajectory.sampled_turns] == [0, 1, 2]


def test_a_sampled_turn_needs_a_log_prob_per_token() -> None:
    with pytest.raises(ValueError, match="2 ids but 1 log-probs"):
        Trajectory(prompt_ids=[1]).add_sampled([2, 3], [-0.1], version=0)


def test_a_template_that_drops_the_tools_is_named_once(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """SmolLM2's template renders no tools: the prompt is the same with and without them,
    and the model would never see them unless the environment's messages describe them."""
    renderer = ChatRenderer(tokenizer, MODEL)
    question = [Message(role="user", content="What is 2 + 3?")]
    with caplog.at_level("WARNING"):
        with_tools = renderer.prompt_ids(question, [LOOKUP])
        renderer.prompt_ids(question, [LOOKUP])
    assert with_tools == renderer.prompt_ids(question, [])
    warnings = [r.getMessage() for r in caplog.records if "does not render tools" in r.getMessage()]
    assert warnings == [
        f"{MODEL}: its chat template does not render tools, so the model sees the "
        "environment's tools (lookup) only where its messages describe them"
    ]


class LimeLookup:
    """The environment of the trajectories above: `lookup` answers "green"; the score
    is 1 for an answer of "green"."""

    def reset(self, row: dict[str, Any]) -> Start:
        self.answer: str | None = None
        return Start(messages=QUESTION, tools=[LOOKUP])

    def step(self, message: Message) -> Step:
        if not message.tool_calls:
            self.answer = (message.content or "").strip()
            return Step(messages=[], done=True)
        answers = [
            Message(role="tool", tool_call_id=c.id, content="green") for c in message.tool_calls
        ]
        return Step(messages=answers)

    def score(self) -> float:
        return 1.0 if self.answer == "green" else 0.0


def test_an_episode_run_against_its_environment_trains_exactly_the_sampled_ids(
    tokenizer: Any, renderer: ChatRenderer
) -> None:
    """The whole EpisodeRunner, on a real environment server, vLLM's Hermes parser and
    SmolLM2's template: the engine (a script here, the one stand-in) samples the call
    with "look" + "up" in it, then "gr" + "een", both where the tokenizer writes one
    token. Each turn continues from exactly the ids before it, and the rollout holds
    them as sampled: a runner that decoded the conversation and encoded it again would
    hand the engine, and train, ids it never sampled. The policy versions follow the
    tokens: the answer, paused after its first token across a weight sync (partial
    rollout, fully async), spans two versions, and the episode three."""
    eot = [renderer.end_of_turn_id]
    split = CALL_TEXT.index("lookup") + len("look")
    call_ids = encode(tokenizer, CALL_TEXT[:split]) + encode(tokenizer, CALL_TEXT[split:]) + eot
    green_ids = encode(tokenizer, "gr") + encode(tokenizer, "een") + eot
    assert call_ids != encode(tokenizer, CALL_TEXT) + eot, "the call must split a merge"
    turns = [call_ids, green_ids]
    versions = [((3, 0),), ((4, 0), (5, 1))]  # (version, its first token), each turn
    prompts: list[list[int]] = []

    async def engine(prompt: list[int], max_tokens: int) -> Rollout:
        turn = len(prompts)
        prompts.append(prompt)
        ids, spans = turns[turn], versions[turn]
        return Rollout(prompt, ids, fake_log_probs(ids, turn), True, spans[0][0], spans)

    limits = EpisodeLimits(max_turns=3, max_tokens=512, turn_tokens=64, call_seconds=10,
                           turn_seconds=10, episode_seconds=30)  # fmt: skip

    async def episode() -> Rollout:
        with served({"lime": app_for(LimeLookup)}) as url:
            replicas = EnvironmentReplicas(f"{url}/lime")
            try:
                return await EpisodeRunner(replicas, renderer, "hermes", limits).run({}, engine, 3)
            finally:
                await replicas.aclose()

    rollout = asyncio.run(episode())
    tool_ids = renderer.observation_ids([Message(role="tool", tool_call_id="x", content="green")])
    assert prompts[1] == prompts[0] + call_ids + tool_ids  # the engine's own ids, then the tool's
    assert rollout.response_token_ids == call_ids + tool_ids + green_ids
    assert list(rollout.loss_mask) == [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(
        green_ids
    )
    assert rollout.response_log_probs == (
        fake_log_probs(call_ids, 0) + [0.0] * len(tool_ids) + fake_log_probs(green_ids, 1)
    )
    assert rollout.episode is not None
    assert (rollout.episode.score, rollout.episode.turns, rollout.episode.tool_calls) == (1.0, 2, 1)
    assert rollout.episode.cut is None
    answer_at = len(call_ids) + len(tool_ids)
    assert rollout.version_spans == ((3, 0), (4, answer_at), (5, answer_at + 1))
    assert (rollout.policy_version, rollout.episode.version_span) == (3, 2)
    whole = rollout.prompt_token_ids + rollout.response_token_ids
    assert encode(tokenizer, tokenizer.decode(whole, skip_special_tokens=False)) != whole
