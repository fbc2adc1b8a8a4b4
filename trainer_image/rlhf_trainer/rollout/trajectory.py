"""The tokens of a multi-turn trajectory: what was sampled, what the environment added,
and which of them the policy is trained on.

The trainer owns the tokens. A trajectory is the prompt's ids followed by segments in
order: a sampled turn keeps the engine's ids exactly as sampled, with their log-probs
and the policy version that sampled them; an observed segment holds what the chat
template and the environment put between turns (the glue after an assistant's end
token, tool messages, the next generation prompt). The loss mask is 1 only on sampled
tokens. Nothing is ever re-tokenised: decoding a conversation and encoding it again
gives other ids than those sampled (BPE merges across the boundary of a sampled turn,
e.g. sampled "gr" + "een" comes back as "green"), and the trainer would then compute
log-probs of tokens the engine never produced.

Tool calls are read from a turn's text by vLLM's own tool parsers (`ToolCallParser`);
tool results become tokens through the model's chat template, rendered incrementally
(`ChatRenderer`). vLLM and transformers are imported inside functions, so this module
imports without them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf_env.protocol import FunctionCall, Message, Tool, ToolCall

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledTurn:
    """One assistant turn as the engine sampled it: trained on (mask 1)."""

    ids: list[int]  # (n,) the engine's token ids, exactly as sampled
    log_probs: list[float]  # (n,) log π_rollout(a_t | s_t) of each, from the engine
    version: int  # the policy version whose weights sampled it
    turn: int  # 0, 1, ... in the trajectory
    tool_calls: int = 0  # calls parsed from it

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError(f"turn {self.turn}: a sampled turn has at least one token")
        if len(self.log_probs) != len(self.ids):
            raise ValueError(
                f"turn {self.turn}: {len(self.ids)} ids but {len(self.log_probs)} log-probs"
            )


@dataclass(frozen=True)
class Observed:
    """Tokens the policy did not sample (template glue, environment messages): mask 0."""

    ids: list[int]  # (n,)


Segment = SampledTurn | Observed


@dataclass
class Trajectory:
    """A prompt and what followed it, token for token. `cut` says why the trajectory
    ended early (`max_turns`, `token_budget`, `environment_timeout: ...`); a cut trajectory
    is not trained on: its mask is all zeros, and callers count it by its reason."""

    prompt_ids: list[int]  # (P,) the rendered prompt, generation prompt included
    segments: list[Segment] = field(default_factory=list)
    cut: str | None = None

    def add_sampled(
        self, ids: Sequence[int], log_probs: Sequence[float], version: int, tool_calls: int = 0
    ) -> SampledTurn:
        self._refuse_if_cut()
        turn = SampledTurn(list(ids), list(log_probs), version, self.turns, tool_calls)
        self.segments.append(turn)
        return turn

    def add_observed(self, ids: Sequence[int]) -> None:
        self._refuse_if_cut()
        self.segments.append(Observed(list(ids)))

    def cut_short(self, reason: str) -> None:
        """End the trajectory early; the first reason stands."""
        self.cut = self.cut or reason

    def _refuse_if_cut(self) -> None:
        if self.cut is not None:
            raise ValueError(f"the trajectory was cut ({self.cut}): nothing more is added")

    @property
    def sampled_turns(self) -> list[SampledTurn]:
        return [s for s in self.segments if isinstance(s, SampledTurn)]

    @property
    def turns(self) -> int:
        return len(self.sampled_turns)

    @property
    def tool_calls(self) -> int:
        return sum(turn.tool_calls for turn in self.sampled_turns)

    @property
    def trainable(self) -> bool:
        return self.cut is None and self.turns > 0

    @property
    def token_ids(self) -> list[int]:  # (T,) prompt, then every segment in order
        return [*self.prompt_ids, *(i for s in self.segments for i in s.ids)]

    @property
    def loss_mask(self) -> list[int]:  # (T,) 1 on sampled tokens of a trainable trajectory
        sampled = 1 if self.trainable else 0
        return [0] * len(self.prompt_ids) + [
            sampled if isinstance(s, SampledTurn) else 0 for s in self.segments for _ in s.ids
        ]

    @property
    def log_probs(self) -> list[float]:  # (T,) the engine's on sampled tokens, 0 elsewhere
        values = [0.0] * len(self.prompt_ids)
        for segment in self.segments:
            if isinstance(segment, SampledTurn):
                values += segment.log_probs
            else:
                values += [0.0] * len(segment.ids)
        return values

    @property
    def versions(self) -> list[int]:  # (turns,) the policy version of each sampled turn
        return [turn.version for turn in self.sampled_turns]

    @property
    def version_span(self) -> int:
        """How many policy versions apart its oldest and newest turns are (0: one policy)."""
        versions = self.versions
        return max(versions) - min(versions) if versions else 0


@dataclass(frozen=True)
class TrajectoryLimits:
    max_turns: int  # sampled turns
    max_tokens: int  # the trajectory's token budget: prompt and every segment


def limit_before_next_turn(trajectory: Trajectory, limits: TrajectoryLimits) -> str | None:
    """Why the trajectory cannot take the turn its environment asks for, or None. Asked
    only when the episode goes on: reaching a limit on the episode's last turn is no cut."""
    if trajectory.turns >= limits.max_turns:
        return "max_turns"
    if len(trajectory.token_ids) >= limits.max_tokens:
        return "token_budget"
    return None


class UnknownToolParser(ValueError):
    pass


class ToolCallParser:
    """A sampled turn's text as an assistant message, its tool calls parsed by vLLM's
    tool parser `name` (e.g. "hermes": `<tool_call>{"name": ..., "arguments": ...}
    </tool_call>`), as vLLM's server would parse them for the same model."""

    def __init__(self, name: str, tokenizer: PreTrainedTokenizerBase, tools: Sequence[Tool]):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        from rlhf_trainer.rollout import toy_tool_parser  # noqa: F401  registers "rlhf_toy"

        known = ToolParserManager.list_registered()
        if name not in known:
            raise UnknownToolParser(f"no tool parser {name!r}; vLLM knows {', '.join(known)}")
        # Parsers read the request's tools (some check names against them); a request
        # with no messages is the smallest one vLLM accepts.
        self._request = ChatCompletionRequest.model_validate(
            {"messages": [], "tools": [t.model_dump(exclude_none=True) for t in tools] or None}
        )
        parser_class = ToolParserManager.get_tool_parser(name)
        self._parser = parser_class(tokenizer, list(self._request.tools or []))

    def parse(self, text: str, turn: int) -> Message:
        """The assistant message of `text`; its calls get ids `call-<turn>-<index>`, unique
        in a trajectory. Text the parser cannot read stays content, with no calls."""
        extracted = self._parser.extract_tool_calls(text, self._request)
        calls = [
            ToolCall(
                id=f"call-{turn}-{index}",
                function=FunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for index, call in enumerate(extracted.tool_calls if extracted.tools_called else [])
        ]
        return Message(role="assistant", content=extracted.content, tool_calls=calls)


class TemplateNotIncremental(ValueError):
    pass


# The conversation the environment's messages are rendered after. Only the text they
# add to it is kept, so what it says does not matter; it must only be a valid chat.
STAND_IN = [
    {"role": "user", "content": "stand-in question"},
    {"role": "assistant", "content": "stand-in answer"},
]


class ChatRenderer:
    """The ids to append after a sampled assistant turn for the messages an environment
    returned, ending with the next assistant turn's generation prompt, rendered through
    the model's chat template without re-tokenising the conversation so far.

    It renders a fixed stand-in conversation with and without the new messages and
    tokenises only the text they add, plus the template's glue after the assistant's
    end-of-turn token (ChatML's "\\n" after `<|im_end|>`): the sampled ids stop at that
    token, so the glue is observed, not sampled. This assumes the rendering of a message
    does not depend on the messages after it (a template that rewrites earlier turns,
    e.g. dropping old reasoning, breaks it); each render checks that the stand-in's text
    is a prefix of the longer one and raises `TemplateNotIncremental` when it is not.
    The added text starts right after a special token, so no BPE merge crosses into it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model: str,
        end_of_turn_id: int | None = None,
    ):
        self.tokenizer, self.model = tokenizer, model
        eot_id = tokenizer.eos_token_id if end_of_turn_id is None else end_of_turn_id
        if not isinstance(eot_id, int):
            raise ValueError(f"{model}: the tokenizer names no end-of-turn (eos) token")
        self.end_of_turn_id = eot_id
        self.end_of_turn = tokenizer.decode([eot_id])
        self._before = self._render(STAND_IN, generation_prompt=False)
        self._warned_about_tools = False  # checked once, on the first prompt with tools
        self._glue = self._glue_after_end_of_turn()

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
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _render(
        self,
        messages: list[dict[str, Any]],
        *,
        generation_prompt: bool,
        tools: Sequence[Tool] = (),
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=[t.model_dump(exclude_none=True) for t in tools] or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        if not isinstance(text, str):
            raise TypeError(f"{self.model}: the chat template rendered {type(text).__name__}")
        return text

    def _glue_after_end_of_turn(self) -> str:
        answer_end = self._before.rindex(STAND_IN[-1]["content"]) + len(STAND_IN[-1]["content"])
        after_answer = self._before[answer_end:]
        if not after_answer.startswith(self.end_of_turn):
            raise TemplateNotIncremental(
                f"{self.model}: its chat template ends an assistant turn with "
                f"{after_answer!r}, not with the end-of-turn token {self.end_of_turn!r}"
            )
        return after_answer[len(self.end_of_turn) :]

    def observation_text(self, messages: Sequence[Message], *, closed: bool = True) -> str:
        """The text to append; `closed`: the sampled turn ended with the end-of-turn
        token (False when generation stopped before it, e.g. on a stop string)."""
        messages_after = STAND_IN + [template_message(m) for m in messages]
        after = self._render(messages_after, generation_prompt=True)
        if not after.startswith(self._before):
            raise TemplateNotIncremental(
                f"{self.model}: its chat template renders a conversation differently once "
                f"messages follow it, so tool results cannot be appended as tokens; "
                f"without them it ends {self._before[-80:]!r}, with them that part reads "
                f"{after[len(self._before) - 80 : len(self._before)]!r}"
            )
        closing = "" if closed else self.end_of_turn
        return closing + self._glue + after[len(self._before) :]

    def observation_ids(self, messages: Sequence[Message], *, closed: bool = True) -> list[int]:
        text = self.observation_text(messages, closed=closed)
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def assistant_text(self, ids: Sequence[int]) -> str:
        """A sampled turn's text for the tool parser: special tokens kept (some models'
        `<tool_call>` is one), the closing end-of-turn token left out."""
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return text


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
