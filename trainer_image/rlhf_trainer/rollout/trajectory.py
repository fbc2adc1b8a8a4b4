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
(`ChatRenderer`, in chat_template.py). vLLM and transformers are imported inside
functions, so this module imports without them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlhf_env.protocol import FunctionCall, Message, Tool, ToolCall

# Re-exported: the renderer lived here, and callers import it from here.
from rlhf_trainer.rollout.chat_template import ChatRenderer as ChatRenderer
from rlhf_trainer.rollout.chat_template import RenderFailed as RenderFailed
from rlhf_trainer.rollout.chat_template import TemplateNotIncremental as TemplateNotIncremental
from rlhf_trainer.rollout.chat_template import template_message as template_message

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
    is not trainable: its loss mask is all zeros, and callers count it by its reason (a
    cut the job's policy trains on takes `sampled_mask`)."""

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
        """End the trajectory early; the first reason stands. Observed tokens after its
        last sampled turn go: nothing was sampled after them, and a cut trajectory is
        never wider than its budget for what the environment added last."""
        self.cut = self.cut or reason
        while self.segments and isinstance(self.segments[-1], Observed):
            self.segments.pop()

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
        return self.sampled_mask if self.trainable else [0] * len(self.token_ids)

    @property
    def sampled_mask(self) -> list[int]:  # (T,) 1 on sampled tokens, cut or not
        return [0] * len(self.prompt_ids) + [
            1 if isinstance(s, SampledTurn) else 0 for s in self.segments for _ in s.ids
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
        described = [t.model_dump(exclude_none=True) for t in tools] or None
        try:
            self._request = ChatCompletionRequest.model_validate(
                {"messages": [], "tools": described}
            )
        except ValueError as failed:  # pydantic's ValidationError: tools vLLM refuses
            raise ToolParseFailed(f"the environment's tools: {failed}") from failed
        parser_class = ToolParserManager.get_tool_parser(name)
        self._parser = parser_class(tokenizer, list(self._request.tools or []))

    def parse(self, text: str, turn: int) -> Message:
        """The assistant message of `text`; its calls get ids `tool_call_id(turn, index)`,
        unique in a trajectory. Text the parser cannot read stays content, with no calls."""
        try:
            extracted = self._parser.extract_tool_calls(text, self._request)
        except Exception as failed:  # a parser's own error, whatever its type
            raise ToolParseFailed(f"turn {turn}: {failed}") from failed
        calls = [
            ToolCall(
                id=tool_call_id(turn, index),
                function=FunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for index, call in enumerate(extracted.tool_calls if extracted.tools_called else [])
        ]
        return Message(role="assistant", content=extracted.content, tool_calls=calls)


class ToolParseFailed(ValueError):
    pass


ID_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def tool_call_id(turn: int, index: int) -> str:
    """The id of a turn's `index`-th call: 9 alphanumeric characters, the only ids that
    Mistral's templates accept (any other template takes them too), the same in every
    episode for the same turn and call: `call` + the turn (3 digits) + the index (2, base
    36). A turn with more calls than that cannot be rendered."""
    if not (0 <= turn < 1000 and 0 <= index < 36 * 36):
        raise ToolParseFailed(f"turn {turn}: no tool call id for call {index}")
    return f"call{turn:03d}{ID_DIGITS[index // 36]}{ID_DIGITS[index % 36]}"
