"""bench/real_model/tool_formats.py's chat templates render incrementally: a Calculator
episode played as the trainer plays it (ChatRenderer's prompt, a sampled call written
as the format writes it, the tool's answer appended as ids, a last sampled turn) gives
the text the template renders for the whole conversation, as vLLM would render it from
the parsed messages, and the appended ids are that render's tail. Every format, with
and without the demonstration (chatTemplateKwargs {demonstration: true}), on SmolLM2's
real tokenizer.

ChatRenderer renders the tool's answer after a stand-in conversation without tools, so
it cannot see a template that renders the system block (tools, demonstration) otherwise
once the model has answered; the whole-conversation comparison does (the last test)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.real_model.tool_formats import FORMATS, chat_template
from rlhf_env.protocol import Message
from rlhf_env.toys import Calculator
from rlhf_trainer.rollout.chat_template import ChatRenderer
from rlhf_trainer.rollout.trajectory import ToolCallParser, Trajectory, template_message
from tests.conftest import needs
from tests.real_model import real_model_dir

pytestmark = needs(
    None
    if (real_model_dir() / "tokenizer.json").exists()
    else f"no SmolLM2 tokenizer at {real_model_dir()} (make real-model)"
)

NUMBERS = [3, 9]
ANSWER = "12"
AFTER_LAST_TURN = "\n"  # ChatML's glue after <|im_end|>, rendered but never sampled
CASES = [
    pytest.param(name, shown, id=f"{name}{'+demonstration' if shown else ''}")
    for name in FORMATS
    for shown in (False, True)
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir())


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def play(renderer: ChatRenderer, parser: str) -> tuple[Trajectory, list[int], list[Message]]:
    """A Calculator episode, token by token as the trainer builds it: the trajectory, the
    ids appended for the tool's answer, and the conversation as messages."""
    tokenizer = renderer.tokenizer
    calculator = Calculator()
    start = calculator.reset({"numbers": NUMBERS})
    trajectory = Trajectory(prompt_ids=renderer.prompt_ids(start.messages, start.tools))
    form = FORMATS[parser]
    written = form.example.replace("4 + 6", " + ".join(map(str, NUMBERS)))
    call_ids = [*encode(tokenizer, written), renderer.end_of_turn_id]
    reader = ToolCallParser(form.parser, tokenizer, start.tools)
    call = reader.parse(renderer.assistant_text(call_ids), turn=0)
    assert [c.function.name for c in call.tool_calls] == ["calculate"], written
    trajectory.add_sampled(call_ids, [-0.5] * len(call_ids), 0, len(call.tool_calls))
    results = calculator.step(call).messages
    assert [m.content for m in results] == [ANSWER]
    tool_ids = renderer.observation_ids(results, closed=renderer.closes(call_ids))
    trajectory.add_observed(tool_ids)
    answer_ids = [*encode(tokenizer, ANSWER), renderer.end_of_turn_id]
    trajectory.add_sampled(answer_ids, [-0.5] * len(answer_ids), 0)
    answer = Message(role="assistant", content=ANSWER)
    return trajectory, tool_ids, [*start.messages, call, *results, answer]


def both_ways(
    tokenizer: Any, template: str, parser: str, demonstration: bool
) -> tuple[Trajectory, list[int], str]:
    """The episode played through `template` (its trajectory, the ids appended for the
    tool's answer) and the template's render of the whole conversation."""
    kwargs = {"demonstration": demonstration}
    renderer = ChatRenderer(tokenizer, parser, template=template, template_kwargs=kwargs)
    trajectory, tool_ids, messages = play(renderer, parser)
    tools = Calculator().reset({"numbers": NUMBERS}).tools
    whole: str = tokenizer.apply_chat_template(
        [template_message(m) for m in messages],
        tools=[t.model_dump(exclude_none=True) for t in tools],
        chat_template=template,
        tokenize=False,
        **kwargs,
    )
    return trajectory, tool_ids, whole


def decoded(tokenizer: Any, trajectory: Trajectory) -> str:
    text: str = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    return text


@pytest.mark.parametrize(("parser", "demonstration"), CASES)
def test_each_format_renders_incrementally(
    tokenizer: Any, parser: str, demonstration: bool
) -> None:
    template = chat_template(parser)
    trajectory, tool_ids, whole = both_ways(tokenizer, template, parser, demonstration)
    assert decoded(tokenizer, trajectory) + AFTER_LAST_TURN == whole
    # Token for token: the whole render ends with the ids appended for the tool's
    # answer and the last turn, and it is the trajectory's ids.
    whole_ids = encode(tokenizer, whole)
    after_last = encode(tokenizer, AFTER_LAST_TURN)
    tail = [*tool_ids, *trajectory.sampled_turns[-1].ids, *after_last]
    assert whole_ids[-len(tail) :] == tail
    assert whole_ids == trajectory.token_ids + after_last
    kwargs = {"demonstration": demonstration}
    renderer = ChatRenderer(tokenizer, parser, template=template, template_kwargs=kwargs)
    start = Calculator().reset({"numbers": NUMBERS})
    prompt = tokenizer.decode(renderer.prompt_ids(start.messages, start.tools))
    assert (FORMATS[parser].example in prompt) == demonstration  # the kwarg reaches it


def test_a_template_that_drops_the_tools_once_answered_renders_otherwise_whole(
    tokenizer: Any,
) -> None:
    """The tools listed only until the first assistant turn: ChatRenderer's stand-in
    (no tools) renders the same either way and it accepts the template; the whole
    conversation renders otherwise than the episode, which the test above compares."""
    answered = "messages | selectattr('role', 'equalto', 'assistant') | list"
    listed_once = "{%- if tools and not (" + answered + ") %}"
    template = chat_template("pythonic")
    assert template.count("{%- if tools %}") == 1
    broken = template.replace("{%- if tools %}", listed_once)
    trajectory, _, whole = both_ways(tokenizer, broken, "pythonic", demonstration=False)
    instructions = "You are an expert in composing functions."
    assert instructions in decoded(tokenizer, trajectory)
    assert instructions not in whole
