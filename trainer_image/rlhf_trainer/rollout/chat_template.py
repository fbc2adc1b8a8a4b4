"""The environment's messages as tokens, through the model's chat template.

`ChatRenderer` renders what an environment answered (tool results, the next generation
prompt) as the ids to append after a sampled assistant turn, without re-tokenising the
conversation so far (trajectory.py says why). It takes the job's template and its
keyword arguments (`multiTurn.chatTemplate`, `chatTemplateKwargs`, e.g. Qwen3's
`enable_thinking`), reads the end-of-turn token from the template (ChatML's `<|im_end|>`,
Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`: not always EOS), and freezes the clock
the template reads (`strftime_now`, Llama 3's "Today Date"), so a render after midnight
continues the prompt rendered before it.

Whatever a template or tokenizer raises while an episode runs becomes `RenderFailed`:
the episode is cut with a named reason (episodes.py), the step and the run go on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_env.protocol import FunctionCall, Message, Tool
from rlhf_trainer.api.agentic import (
    CHAT_TEMPLATE_FILE,
    CHAT_TEMPLATE_MOUNT,
    MultiTurnConfig,
    ObservationTruncation,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# A chat template's keyword arguments (enable_thinking: false, date_string: "1 Jan 2026").
TemplateKwargs = Mapping[str, bool | int | float | str]


class RenderFailed(ValueError):
    """The chat template or the tokenizer failed on an episode's messages."""


class TemplateNotIncremental(RenderFailed):
    pass


# The conversation the environment's messages are rendered after. Only the text they
# add to it is kept, so what it says does not matter; it must only be a valid chat.
STAND_IN = [
    {"role": "user", "content": "stand-in question"},
    {"role": "assistant", "content": "stand-in answer"},
]
ANSWER = STAND_IN[-1]["content"]


class ChatRenderer:
    """The ids to append after a sampled assistant turn for the messages an environment
    returned, ending with the next assistant turn's generation prompt.

    It renders a fixed stand-in conversation followed by the new messages and tokenises
    only what follows the stand-in answer's end-of-turn token: the template's glue after
    it (ChatML's "\\n"), the messages, the next generation prompt. The sampled ids stop at
    that token, so the glue is observed, not sampled. The stand-in's own turn may render
    otherwise once messages follow it (Qwen3 drops the empty `<think>` block of a last
    assistant turn): that turn is the policy's, kept as sampled. What must not change is
    the conversation before it and the answer itself; a template that rewrites them (e.g.
    drops an earlier turn's content) raises `TemplateNotIncremental`. The added text starts
    right after a special token, so no BPE merge crosses into it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model: str,
        *,
        template: str | None = None,
        template_kwargs: TemplateKwargs | None = None,
        end_of_turn_id: int | None = None,
        now: datetime | None = None,
    ):
        self.tokenizer, self.model = tokenizer, model
        self.template = template  # None: the tokenizer's own
        frozen = now or datetime.now()
        # strftime_now shadows transformers' global of that name: one date for the job.
        self._kwargs: dict[str, Any] = {**(template_kwargs or {}), "strftime_now": frozen.strftime}
        self._question = self._render(STAND_IN[:1], generation_prompt=False)
        before = self._render(STAND_IN, generation_prompt=False)
        self.end_of_turn_id = (
            self._end_of_turn_in(before) if end_of_turn_id is None else end_of_turn_id
        )
        self.end_of_turn = tokenizer.decode([self.end_of_turn_id])
        self._stop_ids = {self.end_of_turn_id, *_eos_ids(tokenizer)}
        self._warned_about_tools = False  # checked once, on the first prompt with tools

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool]) -> list[int]:
        """An episode's first prompt: its messages and tools through the chat template,
        ending with the assistant's generation prompt. Encoded without special tokens, as
        for single-turn chat prompts (data/prompts.py): a template writes its own."""
        rendered = [template_message(m) for m in messages]
        text = self._render(rendered, generation_prompt=True, tools=tools)
        if tools and not self._warned_about_tools:
            self._warned_about_tools = True
            if text == self._render(rendered, generation_prompt=True):
                log.warning(
                    "%s: its chat template does not render tools, so the model sees the "
                    "environment's tools (%s) only where its messages describe them",
                    self.model,
                    ", ".join(t.function.name for t in tools),
                )
        return self._encode(text)

    def observation_text(self, messages: Sequence[Message], *, closed: bool = True) -> str:
        """The text to append; `closed`: the sampled turn ended with the end-of-turn
        token (False when generation stopped before it: on another EOS, e.g. Qwen2.5's
        `<|endoftext|>`, or at its token limit)."""
        after = self._render(
            STAND_IN + [template_message(m) for m in messages], generation_prompt=True
        )
        closing = "" if closed else self.end_of_turn
        return closing + self._after_stand_in(after)

    def observation_ids(self, messages: Sequence[Message], *, closed: bool = True) -> list[int]:
        return self._encode(self.observation_text(messages, closed=closed))

    def closes(self, ids: Sequence[int]) -> bool:
        """Whether a sampled turn ended with the end-of-turn token (not just any stop)."""
        return bool(ids) and ids[-1] == self.end_of_turn_id

    def assistant_text(self, ids: Sequence[int]) -> str:
        """A sampled turn's text for the tool parser: special tokens kept (some models'
        `<tool_call>` is one), the token that stopped it (end of turn, EOS) left out."""
        if ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        try:
            text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        except Exception as failed:  # a tokenizer's own error, whatever its type
            raise RenderFailed(f"{self.model}: decoding a turn: {failed}") from failed
        return text

    def bounded(
        self,
        messages: Sequence[Message],
        max_tokens: int | None,
        truncation: ObservationTruncation = "tail",
    ) -> list[Message]:
        """Each message's content cut to `max_tokens` tokens, at a marker that says how
        many were left out (multiTurn.maxObservationTokens); `truncation`: the part cut,
        its tail, its head or its middle. None: as they are."""
        return [self._bounded(m, max_tokens, truncation) for m in messages]

    def _bounded(
        self, message: Message, max_tokens: int | None, truncation: ObservationTruncation
    ) -> Message:
        if max_tokens is None or not message.content:
            return message
        ids = self._encode(message.content)
        if len(ids) <= max_tokens:
            return message
        marker = f"[... {len(ids) - max_tokens} of {len(ids)} tokens cut]"
        head = {"tail": max_tokens, "head": 0, "middle": (max_tokens + 1) // 2}[truncation]
        tail = max_tokens - head
        parts = [self._decode(ids[:head]), marker, self._decode(ids[len(ids) - tail :])]
        content = "\n".join(part for part in parts if part)
        return message.model_copy(update={"content": content})

    def _decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False) if ids else ""
        return text

    def _end_of_turn_in(self, rendered: str) -> int:
        """The special token the template ends an assistant turn with: the first token
        after the stand-in answer."""
        after_answer = rendered[rendered.rindex(ANSWER) + len(ANSWER) :]
        ids = self._encode(after_answer)
        if ids and ids[0] in _special_ids(self.tokenizer):
            return ids[0]
        raise TemplateNotIncremental(
            f"{self.model}: its chat template ends an assistant turn with "
            f"{after_answer[:40]!r}, which starts with no special token to stop a turn on"
        )

    def _after_stand_in(self, after: str) -> str:
        start = len(self._question)
        end = after.find(ANSWER + self.end_of_turn, start)
        if not after.startswith(self._question) or end < 0:
            raise TemplateNotIncremental(
                f"{self.model}: its chat template renders a conversation differently once "
                f"messages follow it, so tool results cannot be appended as tokens; the "
                f"stand-in conversation renders as {after[: start + 80]!r}"
            )
        return after[end + len(ANSWER) + len(self.end_of_turn) :]

    def _render(
        self,
        messages: list[dict[str, Any]],
        *,
        generation_prompt: bool,
        tools: Sequence[Tool] = (),
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=[t.model_dump(exclude_none=True) for t in tools] or None,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self._kwargs,
            )
        except Exception as failed:  # Jinja's raise_exception, or any error in a template
            raise RenderFailed(f"{self.model}: its chat template failed: {failed}") from failed
        if not isinstance(text, str):
            raise TypeError(f"{self.model}: the chat template rendered {type(text).__name__}")
        return text

    def _encode(self, text: str) -> list[int]:
        try:
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as failed:  # a tokenizer's own error, whatever its type
            raise RenderFailed(f"{self.model}: its tokenizer failed: {failed}") from failed
        return ids


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return {*tokenizer.all_special_ids, *(i for i, token in added.items() if token.special)}


def _eos_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS, and the pad token: Qwen2.5 also stops on it (its generation config lists
    `<|im_end|>` and `<|endoftext|>`, its pad token)."""
    ids = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    return {i for i in ids if isinstance(i, int)}


def template_message(message: Message) -> dict[str, Any]:
    """A message as chat templates take it: content always a string (templates
    concatenate it), a call's arguments as an object where they parse (as transformers
    documents them and vLLM hands them to templates)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": _template_function(c.function)}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_function(function: FunctionCall) -> dict[str, Any]:
    try:
        arguments: Any = function.parsed_arguments()
    except ValueError:
        arguments = function.arguments
    return {"name": function.name, "arguments": arguments}


def job_template(
    multi_turn: MultiTurnConfig, mount: Path = Path(CHAT_TEMPLATE_MOUNT)
) -> str | None:
    """The job's chat template: multiTurn.chatTemplate, or chatTemplateFrom's ConfigMap
    key, which the operator mounts as `mount`/CHAT_TEMPLATE_FILE; None: the tokenizer's.
    A local run has no ConfigMap, so no such file: that fails, saying so."""
    source = multi_turn.chat_template_from
    if source is None:
        return multi_turn.chat_template
    ref, path = source.config_map_key_ref, mount / CHAT_TEMPLATE_FILE
    where = f"generation.multiTurn.chatTemplateFrom: key {ref.key!r} of ConfigMap {ref.name!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(
            f"{where}: no file {path}, where the operator mounts it in the Ray pods (a local "
            "run has no ConfigMap: give the template inline, as multiTurn.chatTemplate)"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: cannot read {path}: {error}") from error
    if not text.strip():
        raise ValueError(f"{where}: {path} is empty; expected a Jinja chat template")
    return text
