"""The chat-template families people train, each run through the project's own
ChatRenderer and Trajectory with vLLM's matching tool parser (hermes, llama3_json,
mistral, pythonic): a question, a turn that calls `lookup`, the tool's answer appended
as tokens, a last turn. The appended ids must be what the family's template renders
for the whole conversation, as vLLM would render it from the parsed messages; where
the family serves a sampled turn otherwise (Qwen3 without thinking drops the empty
`<think>` block its generation prompt gave), the test says so.

The templates are test data (tests/unit/data/chat_templates, their source named);
the tokenizers are built here with each family's special tokens (tests/chat_families.py).
"""

from __future__ import annotations

import string
from datetime import datetime
from typing import Any

import pytest

from rlhf_env.protocol import Message
from rlhf_trainer.rollout.chat_template import ChatRenderer, RenderFailed
from rlhf_trainer.rollout.trajectory import (
    ToolCallParser,
    ToolParseFailed,
    Trajectory,
    template_message,
    tool_call_id,
)
from tests.chat_families import (
    FAMILIES,
    GEMMA,
    HERMES_CALL,
    LOOKUP,
    TEMPLATES,
    Family,
    qwen,
    recorded_sha256,
    sha256,
    template_text,
    tokenizer_of,
)
from tests.conftest import needs
from tests.real_model import real_model_dir

NOW = datetime(2026, 12, 6, 23, 59, 59)  # the job's start, a second before midnight
QUESTION = [Message(role="user", content="What is the value of the key 'lime'?")]
EMPTY_THINK = "<think>\n\n</think>\n\n"


def renderer_of(family: Family) -> ChatRenderer:
    return ChatRenderer(
        tokenizer_of(family),
        family.name,
        template=template_text(family.template),
        template_kwargs=family.kwargs,
        now=NOW,
    )


def named(template: str) -> Family:
    (family,) = [f for f in FAMILIES if f.template == template]
    return family


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def test_the_templates_are_their_sources_unchanged() -> None:
    names = sorted(path.stem for path in TEMPLATES.glob("*.jinja"))
    assert len(names) == 8
    for name in names:
        assert sha256(template_text(name)) == recorded_sha256(name), name


def play(family: Family, renderer: ChatRenderer) -> tuple[Trajectory, list[int], Message]:
    """The episode, token by token as the trainer builds it; returns the trajectory, the
    ids appended for the tool's answer, and the parsed call turn."""
    tokenizer = renderer.tokenizer
    trajectory = Trajectory(prompt_ids=renderer.prompt_ids(QUESTION, [LOOKUP]))
    stop = tokenizer.convert_tokens_to_ids(family.call_stop or family.end_of_turn)
    call_ids = [*encode(tokenizer, family.call), stop]
    parser = ToolCallParser(family.parser, tokenizer, [LOOKUP])
    assistant = parser.parse(renderer.assistant_text(call_ids), turn=0)
    trajectory.add_sampled(call_ids, [-0.5] * len(call_ids), 0, len(assistant.tool_calls))
    (call,) = assistant.tool_calls
    assert (call.function.name, call.function.parsed_arguments()) == ("lookup", {"key": "lime"})
    answer = Message(role="tool", tool_call_id=call.id, content="green")
    tool_ids = renderer.observation_ids([answer], closed=renderer.closes(call_ids))
    trajectory.add_observed(tool_ids)
    answer_ids = [*encode(tokenizer, family.answer), renderer.end_of_turn_id]
    trajectory.add_sampled(answer_ids, [-0.5] * len(answer_ids), 0)
    return trajectory, tool_ids, assistant


def whole_conversation(family: Family, assistant: Message, tokenizer: Any = None) -> str:
    """The conversation rendered whole, as vLLM renders a request from its messages."""
    if family.calls_as_content:  # SmolLM2's template renders an assistant's content only
        assistant = Message(role="assistant", content=family.call)
    call_id = assistant.tool_calls[0].id if assistant.tool_calls else "call00000"
    messages = [
        *QUESTION,
        assistant,
        Message(role="tool", tool_call_id=call_id, content="green"),
        Message(role="assistant", content=family.answer),
    ]
    text: str = (tokenizer or tokenizer_of(family)).apply_chat_template(
        [template_message(m) for m in messages],
        tools=[LOOKUP.model_dump(exclude_none=True)],
        chat_template=template_text(family.template),
        tokenize=False,
        strftime_now=NOW.strftime,
        **family.kwargs,
    )
    return text


def as_served(family: Family, text: str, call_id: str) -> str:
    """The trajectory's text as the family serves the same conversation. Where that
    differs, it differs in the sampled call turn only, which stays as sampled."""
    if family.kwargs.get("enable_thinking") is False:
        text = text.replace(EMPTY_THINK, "", 1)  # dropped once messages follow the turn
    if family.call_stop is not None:
        text = text.replace(family.call_stop, "", 1)  # the turn stopped on another EOS
    if family.parser == "mistral":
        text = text.replace("abcDEF123", call_id)  # vLLM gives calls ids of its own too
    return text


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_the_appended_ids_are_what_the_template_renders_for_the_whole_conversation(
    family: Family,
) -> None:
    renderer = renderer_of(family)
    tokenizer = renderer.tokenizer
    assert renderer.end_of_turn == family.end_of_turn  # read from the template
    trajectory, tool_ids, assistant = play(family, renderer)
    whole = whole_conversation(family, assistant)

    text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    served = as_served(family, text, assistant.tool_calls[0].id)
    assert served + family.after_last_turn == whole
    # Token for token: the whole render ends with the ids appended for the tool's
    # answer, then the last turn (and the template's glue after it) ...
    whole_ids = encode(tokenizer, whole)
    after_last = encode(tokenizer, family.after_last_turn)
    tail = tool_ids + trajectory.sampled_turns[-1].ids + after_last
    assert whole_ids[-len(tail) :] == tail
    # ... and where the family serves the sampled turns as sampled, it is the trajectory.
    if served == text:
        assert whole_ids == trajectory.token_ids + after_last


def test_qwen3s_stand_in_renders_an_empty_think_block_and_is_accepted() -> None:
    """Qwen3 renders a last assistant turn with an empty <think> block and drops it once
    messages follow: the stand-in's own turn changes, and that is no rewrite of the
    conversation. The tool's answer is appended as the template renders it."""
    renderer = renderer_of(qwen())
    stand_in = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert EMPTY_THINK in renderer.tokenizer.apply_chat_template(
        stand_in, chat_template=template_text("qwen3"), tokenize=False
    )
    answer = Message(role="tool", tool_call_id="call00000", content="green")
    assert renderer.observation_text([answer]) == (
        "\n<|im_start|>user\n<tool_response>\ngreen\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    thinking_off = renderer_of(qwen(kwargs={"enable_thinking": False}))
    assert thinking_off.observation_text([answer]).endswith("<|im_start|>assistant\n" + EMPTY_THINK)


def test_a_turn_that_stopped_on_another_eos_is_closed_by_the_observation() -> None:
    """Qwen2.5 stops on <|endoftext|> as well as <|im_end|>: such a turn is not closed
    (whatever the finish reason), so <|im_end|> is appended before the tool's answer."""
    family = qwen(template="qwen2_5")
    renderer = renderer_of(family)
    tokenizer = renderer.tokenizer
    call = [*encode(tokenizer, HERMES_CALL), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    assert not renderer.closes(call)
    assert renderer.closes([*call[:-1], renderer.end_of_turn_id])
    assert renderer.assistant_text(call) == HERMES_CALL  # the stop token is not the parser's
    answer = Message(role="tool", tool_call_id="call00000", content="green")
    assert renderer.observation_text([answer], closed=False).startswith("<|im_end|>\n<|im_start|>")


def test_llamas_date_is_the_jobs_start_after_midnight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3.2 stamps strftime_now's date into the system block. The clock moves past
    midnight between the prompt and the tool's answer; the renderer keeps the job's."""
    from transformers.utils import chat_template_utils

    clock = [NOW]

    class Clock:
        @staticmethod
        def now() -> datetime:
            return clock[0]

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)
    template = template_text("llama3_2")
    renderer = ChatRenderer(tokenizer_of(named("llama3_2")), "llama3_2", template=template)
    prompt = renderer.tokenizer.decode(renderer.prompt_ids(QUESTION, [LOOKUP]))
    assert "Today Date: 06 Dec 2026" in prompt
    clock[0] = datetime(2026, 12, 7, 0, 0, 1)
    answer = Message(role="tool", tool_call_id="call00000", content="green")
    assert renderer.observation_text([answer]).startswith("<|start_header_id|>ipython")
    # A renderer that read the clock would now refuse every tool result of the episode.
    clock[0] = NOW
    unfrozen = ChatRenderer(renderer.tokenizer, "llama3_2", template=template, now=NOW)
    unfrozen._kwargs.pop("strftime_now")
    clock[0] = datetime(2026, 12, 7, 0, 0, 1)
    with pytest.raises(RenderFailed, match="differently once messages follow"):
        unfrozen.observation_text([answer])


def test_tool_call_ids_are_nine_alphanumerics_the_same_for_the_same_turn() -> None:
    ids = [tool_call_id(turn, index) for turn in (0, 1, 255) for index in (0, 1, 35, 36, 1295)]
    assert len(set(ids)) == len(ids)
    alphanumeric = set(string.ascii_letters + string.digits)
    assert all(len(i) == 9 and set(i) <= alphanumeric for i in ids)
    assert tool_call_id(3, 1) == tool_call_id(3, 1) == "call00301"
    with pytest.raises(ToolParseFailed):
        tool_call_id(0, 36 * 36)


def test_mistral_refuses_ids_of_another_length_and_takes_the_trainers() -> None:
    renderer = renderer_of(named("mistral_v0_3"))
    with pytest.raises(RenderFailed, match="length 9"):  # the trainer's ids until issue 72
        renderer.observation_text([Message(role="tool", tool_call_id="call-0-0", content="x")])
    text = renderer.observation_text(
        [Message(role="tool", tool_call_id=tool_call_id(0, 0), content="x")]
    )
    assert text == '[TOOL_RESULTS] {"content": x, "call_id": "call00000"}[/TOOL_RESULTS]'


def gemma2() -> ChatRenderer:
    family = Family("gemma2", "pythonic", GEMMA, "<bos>", "<eos>", "<end_of_turn>", "", pad="<pad>")
    return ChatRenderer(tokenizer_of(family), "gemma2", template=template_text("gemma2"))


def test_gemma_ends_a_turn_with_end_of_turn_not_eos() -> None:
    renderer = gemma2()
    assert (renderer.end_of_turn, renderer.tokenizer.eos_token) == ("<end_of_turn>", "<eos>")
    answer = Message(role="user", content="It is green.")  # Gemma 2 has no tool role
    assert renderer.observation_text([answer]) == (
        "\n<start_of_turn>user\nIt is green.<end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_role_the_template_refuses_is_a_render_failure_naming_it() -> None:
    with pytest.raises(RenderFailed, match=r"gemma2: its chat template failed: .*alternate"):
        gemma2().observation_ids([Message(role="tool", tool_call_id="call00000", content="x")])


@needs(
    None
    if (real_model_dir() / "tokenizer.json").exists()
    else f"no SmolLM2 tokenizer at {real_model_dir()} (make real-model)"
)
def test_a_real_instruct_models_tokenizer_takes_another_familys_template() -> None:
    """multiTurn.chatTemplate on a real model: SmolLM2's own BPE (ChatML's tokens, a
    template that renders no tools) with Qwen3's template, thinking off. The appended
    text is what the template renders for the whole conversation, and the appended ids
    are that text's. (Encoding the whole render at once gives other ids at the seams
    where a turn follows the generation prompt's "\n\n": the drift the trainer avoids
    by never re-tokenising.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir())
    family = qwen(kwargs={"enable_thinking": False})
    renderer = ChatRenderer(tokenizer, "SmolLM2 with Qwen3's template",
                            template=template_text("qwen3"), template_kwargs=family.kwargs)  # fmt: skip
    assert "<tools>" in tokenizer.decode(renderer.prompt_ids(QUESTION, [LOOKUP]))
    trajectory, tool_ids, assistant = play(family, renderer)
    whole = whole_conversation(family, assistant, tokenizer)
    text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    assert as_served(family, text, assistant.tool_calls[0].id) + "\n" == whole
    observed = tokenizer.decode(tool_ids, skip_special_tokens=False)
    start = whole.rindex("</tool_call><|im_end|>") + len("</tool_call><|im_end|>")
    assert whole[start : start + len(observed)] == observed
    assert tool_ids == encode(tokenizer, observed)
