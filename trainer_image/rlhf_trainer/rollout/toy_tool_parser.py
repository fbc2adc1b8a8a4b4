"""vLLM tool parser `rlhf_toy`: the tool-call syntax of the tiny models' chat template.

A tiny model's turn is a few words (models.TINY_CHAT_TEMPLATE). A turn whose first
word is "call" calls the request's first tool with the next word as its first required
argument, and the rest of the turn is ignored (a trailing end-of-turn token too); any
other turn is content, with no calls. Forgiving on purpose: a randomly initialised
model must stumble on a call by itself, and two chosen words then a stop is a 1 in
64^3 event for a 64-word vocabulary, while a first word of "call" is 1 in 64: within
reach of a few hundred episodes, and the toy environments (rlhf_env.toys) need no more.

Registered under vLLM's own tool-parser registry, so `ToolCallParser("rlhf_toy", ...)`
reads tiny models' turns as it reads real models' turns with "hermes".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaMessage,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

from rlhf_trainer.models import CALL

NAME = "rlhf_toy"


def first_argument(parameters: dict[str, Any] | None) -> str | None:
    """The argument a one-word call fills: the schema's first required one, else its
    first property; None when the tool takes no arguments."""
    parameters = parameters or {}
    required = parameters.get("required") or []
    if required:
        return str(required[0])
    properties = parameters.get("properties") or {}
    return next(iter(properties), None)


def call_word(words: Sequence[str]) -> str | None:
    """X when the words start `call X` (whatever follows), else None."""
    if len(words) >= 2 and words[0] == CALL:
        return words[1]
    return None


# Decorator form: vLLM records the module path and class name (a lazy entry), so the
# name resolves in any process that imports this module, or that can import it by path.
@ToolParserManager.register_module(NAME)
class ToyToolParser(ToolParser):  # type: ignore[misc]  # vLLM is untyped here
    """`call X ...` -> one call of the request's first tool; anything else -> content."""

    # The syntax is not JSON: vLLM's JSON-guided decoding for tool_choice "required" or
    # a named tool would force a format this parser never reads.
    supports_required_and_named = False

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        words = model_output.split()
        end_of_turn = getattr(self.model_tokenizer, "eos_token", None)
        if words and words[-1] == end_of_turn:
            words = words[:-1]
        value = call_word(words)
        tools = request.tools or []
        argument = first_argument(tools[0].function.parameters) if tools else None
        if value is None or argument is None:
            return ExtractedToolCallInformation(
                tools_called=False, tool_calls=[], content=" ".join(words)
            )
        function = FunctionCall(
            name=tools[0].function.name, arguments=json.dumps({argument: value})
        )
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=[ToolCall(function=function)], content=None
        )

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        # The trainer parses whole turns; a streaming server should not pick this parser.
        raise NotImplementedError(f"tool parser {NAME!r} parses whole turns only")
