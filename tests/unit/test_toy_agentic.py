"""The tiny models' side of multi-turn tool use, without an engine: their chat template,
the `rlhf_toy` tool parser (through vLLM's registry, as rollouts use it), the
LetterLookup environment and the toy:lookup rows.

The last test plays a whole conversation as a rollout builds it, sampled turns plus
rendered observations, and checks the tokens equal the whole rendered conversation's:
for the word-level tokenizer, incremental rendering agrees with full rendering.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_env.protocol import FunctionCall, Message, ToolCall
from rlhf_env.toys import Calculator, LetterLookup
from rlhf_trainer.api.sections import DataConfig, ModelSource, TinyModel
from rlhf_trainer.data.sources import PromptRow, load_prompt_rows
from rlhf_trainer.data.tasks import (
    is_held_out,
    lookup_held_out_rows,
    lookup_rows,
    toy_prompts,
    toy_rows,
)
from rlhf_trainer.models import chat_tokenizer, load_tokenizer, vocabulary
from rlhf_trainer.rollout.trajectory import (
    ChatRenderer,
    ToolCallParser,
    Trajectory,
    template_message,
)

TINY = ModelSource(tiny=TinyModel(vocab_size=64))
ROW = {"key": "c", "value": "x"}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chat_tokenizer(TINY)


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> ChatRenderer:
    return ChatRenderer(tokenizer, "tiny")


@pytest.fixture(scope="module")
def parser(tokenizer: Any) -> ToolCallParser:
    tools = LetterLookup().reset(ROW).tools
    return ToolCallParser("rlhf_toy", tokenizer, tools)


def words(tokenizer: Any, ids: list[int]) -> str:
    return " ".join(tokenizer.convert_ids_to_tokens(ids))


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def lookup_call(key: str, call_id: str = "call-0-0") -> ToolCall:
    return ToolCall(
        id=call_id, function=FunctionCall(name="lookup", arguments=f'{{"key": "{key}"}}')
    )


def assistant(content: str | None = None, *calls: ToolCall) -> Message:
    return Message(role="assistant", content=content, tool_calls=list(calls))


def tool_answer(content: str, call_id: str = "call-0-0") -> Message:
    return Message(role="tool", tool_call_id=call_id, content=content)


IDEAL = [
    Message(role="user", content="c"),
    assistant(None, lookup_call("c")),
    tool_answer("x"),
    assistant("x"),
]


def render(tokenizer: Any, messages: list[Message], generation_prompt: bool = False) -> str:
    text: str = tokenizer.apply_chat_template(
        [template_message(m) for m in messages],
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    return text


def test_the_tool_words_follow_the_copy_tasks_symbols() -> None:
    vocab = vocabulary(64)
    assert (vocab[40], vocab[41], vocab[42], vocab[43], vocab[63]) == (
        "9",
        "call",
        "result",
        "<extra_0>",
        "<extra_20>",
    )


def test_the_template_renders_a_conversation_word_by_word(tokenizer: Any) -> None:
    assert render(tokenizer, IDEAL[:1], generation_prompt=True) == "<s>c ="
    prompt_ids = encode(tokenizer, render(tokenizer, IDEAL[:1], generation_prompt=True))
    assert words(tokenizer, prompt_ids) == "<s> c ="
    ids = encode(tokenizer, render(tokenizer, IDEAL))
    assert words(tokenizer, ids) == "<s> c = call c </s> result x = x </s>"
    two_calls = assistant(None, lookup_call("a", "call-0-0"), lookup_call("b", "call-0-1"))
    assert render(tokenizer, [two_calls]) == "<s>call a call b</s>"


def test_only_the_multi_turn_tokenizer_has_the_template() -> None:
    # The copy task's prompts are rendered through a template whenever there is one.
    assert not getattr(load_tokenizer(TINY), "chat_template", None)
    too_small = ModelSource(tiny=TinyModel(vocab_size=41))
    with pytest.raises(ValueError, match=r"vocabSize >= 43"):
        chat_tokenizer(too_small)


def test_the_renderer_appends_exactly_the_tool_result(
    tokenizer: Any, renderer: ChatRenderer
) -> None:
    ids = renderer.observation_ids([tool_answer("x")])
    assert ids == encode(tokenizer, "result x =")
    assert words(tokenizer, ids) == "result x ="
    # A turn cut before its end-of-turn token gets it as an observation.
    unclosed = renderer.observation_ids([tool_answer("x")], closed=False)
    assert words(tokenizer, unclosed) == "</s> result x ="


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("call c </s>", "c"),
        ("call c", "c"),
        ("  call   h  ", "h"),
        ("call a b", "a"),
        ("call call", "call"),
        ("call c d e </s>", "c"),
    ],
)
def test_a_call_is_a_turn_whose_first_word_is_call(
    parser: ToolCallParser, text: str, key: str
) -> None:
    """The word after "call" is the argument; the rest of the turn is ignored."""
    message = parser.parse(text, turn=2)
    assert message.content is None
    assert [(c.id, c.function.name, c.function.parsed_arguments()) for c in message.tool_calls] == [
        ("call00200", "lookup", {"key": key})
    ]


@pytest.mark.parametrize(
    ("text", "content"),
    [("c </s>", "c"), ("call", "call"), ("call </s>", "call"), ("a call b", "a call b")],
)
def test_anything_else_is_content(parser: ToolCallParser, text: str, content: str) -> None:
    message = parser.parse(text, turn=0)
    assert (message.content, message.tool_calls) == (content, [])


def test_a_call_fills_the_first_required_argument(tokenizer: Any) -> None:
    from rlhf_env.protocol import Tool, ToolFunction

    properties = {"table": {"type": "string"}, "name": {"type": "string"}}
    schemas = [
        ({"type": "object", "properties": properties, "required": ["name"]}, "name"),
        ({"type": "object", "properties": properties}, "table"),
    ]
    for schema, argument in schemas:
        tools = [Tool(function=ToolFunction(name="find", parameters=schema))]
        message = ToolCallParser("rlhf_toy", tokenizer, tools).parse("call c", turn=0)
        assert message.tool_calls[0].function.parsed_arguments() == {argument: "c"}
    no_tools = ToolCallParser("rlhf_toy", tokenizer, []).parse("call c", turn=0)
    assert (no_tools.content, no_tools.tool_calls) == ("call c", [])


def play(turns: list[Message]) -> tuple[LetterLookup, list[list[Message]]]:
    """LetterLookup on ROW through `turns` (assistant messages); what it answered."""
    environment = LetterLookup()
    start = environment.reset(ROW)
    assert [m.content for m in start.messages] == ["c"]
    assert [t.function.name for t in start.tools] == ["lookup"]
    answers = []
    for number, turn in enumerate(turns):
        step = environment.step(turn)
        answers.append(step.messages)
        assert step.done == (number == len(turns) - 1) == (not turn.tool_calls)
    return environment, answers


@pytest.mark.parametrize(
    ("turns", "score"),
    [
        ([assistant(None, lookup_call("c")), assistant("x ")], 1.0),
        ([assistant(None, lookup_call("c")), assistant("x y </s>")], 1.0),
        (
            [assistant(None, lookup_call("d")), assistant(None, lookup_call("c")), assistant("x")],
            1.0,
        ),
        ([assistant(None, lookup_call("c")), assistant("y x")], 0.5),
        ([assistant(None, lookup_call("c")), assistant(None)], 0.5),
        ([assistant(None, lookup_call("d")), assistant("x")], 0.25),
        ([assistant(None, lookup_call("d")), assistant("y")], 0.25),
        ([assistant("x")], 0.0),  # a guess, even a right one, earns nothing
        ([assistant("call c")], 0.0),
    ],
)
def test_letter_lookup_scores_a_call_the_key_then_the_answer(
    turns: list[Message], score: float
) -> None:
    environment, _ = play(turns)
    assert environment.score() == score


def test_letter_lookup_answers_each_call_with_the_value_or_0() -> None:
    calls = assistant(None, lookup_call("d", "call-0-0"), lookup_call("c", "call-0-1"))
    _, answers = play([calls, assistant("x")])
    assert [(m.tool_call_id, m.content) for m in answers[0]] == [
        ("call-0-0", "0"),
        ("call-0-1", "x"),
    ]


def test_toy_lookup_rows_are_seeded_and_never_held_out() -> None:
    rows = lookup_rows(500, seed=3)
    assert rows == lookup_rows(500, seed=3) != lookup_rows(500, seed=4)
    assert not any(is_held_out([r["key"], r["value"]]) for r in rows)
    held_out = lookup_held_out_rows()
    assert len(held_out) == len({(r["key"], r["value"]) for r in held_out}) > 0
    assert all(is_held_out([r["key"], r["value"]]) for r in held_out)
    assert {(r["key"], r["value"]) for r in rows} | {(r["key"], r["value"]) for r in held_out} == {
        (k, v) for k in "abcdefgh" for v in "abcdefgh"
    }
    assert toy_rows("toy:lookup", 5, seed=3) == rows[:5]
    assert toy_rows("toy:lookup:heldout", 5, seed=3) == held_out


def test_toy_lookup_rows_are_data_rows_without_prompt_text() -> None:
    rows = load_prompt_rows(DataConfig(train="toy:lookup", eval="toy:lookup:heldout"), 0)
    assert rows[0] == PromptRow("", lookup_rows(1, seed=0)[0])
    held_out = load_prompt_rows(DataConfig(train="toy:copy", eval="toy:lookup:heldout"), 0, "eval")
    assert [r.fields for r in held_out] == lookup_held_out_rows()
    with pytest.raises(ValueError, match="multi-turn task"):
        toy_prompts("toy:lookup", 1, 0)
    with pytest.raises(ValueError, match="single-turn task"):
        toy_rows("toy:copy", 1, 0)
    with pytest.raises(ValueError, match="toy:lookup, toy:lookup:heldout"):
        toy_rows("toy:sort", 1, 0)


def test_a_scripted_episode_builds_the_tokens_of_the_whole_rendered_conversation(
    tokenizer: Any, renderer: ChatRenderer, parser: ToolCallParser
) -> None:
    """Turns as the engine would sample them (ending in </s>), parsed, stepped through the
    environment, and its answers appended as ChatRenderer renders them."""
    environment = LetterLookup()
    start = environment.reset(ROW)
    prompt = render(tokenizer, start.messages, generation_prompt=True)
    trajectory = Trajectory(prompt_ids=encode(tokenizer, prompt))
    conversation = list(start.messages)
    for number, sampled_text in enumerate(["call d </s>", "call c </s>", "x </s>"]):
        ids = encode(tokenizer, sampled_text)
        message = parser.parse(renderer.assistant_text(ids), turn=number)
        trajectory.add_sampled(ids, [-1.0] * len(ids), version=0)
        conversation.append(message)
        step = environment.step(message)
        if step.done:
            break
        trajectory.add_observed(renderer.observation_ids(step.messages))
        conversation += step.messages

    assert step.done and environment.score() == 1.0
    whole = encode(tokenizer, render(tokenizer, conversation))
    assert trajectory.token_ids == whole
    assert words(tokenizer, whole) == (
        "<s> c = call d </s> result 0 = call c </s> result x = x </s>"
    )
    assert trajectory.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]


def calculate_call(expression: str) -> Message:
    arguments = f'{{"expression": "{expression}"}}'
    call = ToolCall(id="call000000", function=FunctionCall(name="calculate", arguments=arguments))
    return Message(role="assistant", tool_calls=[call])


def test_calculator_rewards_the_first_valid_call_only_when_the_row_asks() -> None:
    shaped = Calculator()
    shaped.reset({"numbers": [3, 9], "call_reward": 0.5})
    assert shaped.step(calculate_call("3 +")).reward is None  # an error: not a valid call
    assert shaped.step(calculate_call("3 + 9")).reward == 0.5
    assert shaped.step(calculate_call("3 + 9")).reward is None  # the first valid turn only
    shaped.step(Message(role="assistant", content="12"))
    assert shaped.score() == 1.0  # the score is the answer's alone
    plain = Calculator()
    plain.reset({"numbers": [3, 9]})
    assert plain.step(calculate_call("3 + 9")).reward is None
