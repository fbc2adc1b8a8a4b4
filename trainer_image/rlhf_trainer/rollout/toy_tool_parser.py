"""vLLM tool parser `rlhf_toy`: the tool-call syntax of the tiny models' chat template.

A tiny model's turn is a few words (models.TINY_CHAT_TEMPLATE). A turn that reads
`call X` (the word "call", then exactly one word; a trailing end-of-turn token is
ignored) calls the request's first tool with X as its first required argument; any
other turn is content, with no calls. One word of syntax is all a randomly initialised
model needs to stumble on a call, and all the toy environments (rlhf_env.toys) take.

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
    """X when the words are exactly `call X`, else None."""
    if len(words) == 2 and words[0] == CALL:
        return words[1]
    return None


# Decorator form: vLLM records the module path and class name (a lazy entry), so the
# name resolves in any process that imports this module, or that can import it by path.
@ToolParserManager.register_module(NAME)
class ToyToolParser(ToolParser):  # type: ignore[misc]  # vLLM is untyped here
    """`call X` -> one call of the request's first tool; anything else -> content."""

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
