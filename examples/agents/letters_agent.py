"""A plain agent, written only against the `openai` package, for the toy lookup task of
examples/agentic-tools.yaml: each task is a key letter and its value (`{"key": "c",
"value": "x"}`); the model should call the `lookup` tool with the key and answer with
the value it returned. The agent runs its own loop: it offers the tool, runs the calls
itself, appends their results and asks again, then grades the answer.

Serve it (from the repository root):

    python -m rlhf_env agent examples.agents.letters_agent:run --port 8000

or run this file: its last lines are the five-line adapter (rlhf_env.agent.serve).

It grades as rlhf_env.toys.LetterLookup scores the trainer-driven job's episodes (a test
holds the two equal), so their learning compares: 0 without a lookup, 0.25 for a lookup
of another key only, 0.5 for the row's key, 1 for that and an answer whose first word is
the value. An episode still calling tools after TURNS calls scores 0, as the trainer-driven
job's max_turns cut does by default.
"""

from __future__ import annotations

import json
from typing import Any, cast

import openai
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageParam,
    ChatCompletionMessageToolCallUnion,
)

TURNS = 2  # a lookup, then the answer
NO_SUCH_KEY = "0"  # the tool's answer to a key the task does not hold
LOOKUP_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the key to look up"}},
            "required": ["key"],
        },
    },
}


async def run(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> float:
    """One episode: the model's calls of `lookup` answered here, until it answers."""
    key, value = str(task["key"]), str(task["value"])
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": key}]
    asked: list[str] = []  # the keys the model looked up
    for _ in range(TURNS):
        completion = await client.chat.completions.create(
            model=model, messages=messages, tools=[LOOKUP_TOOL]
        )
        reply = completion.choices[0].message
        # The reply as the next call sends it back (its tool calls with their ids).
        messages.append(cast(ChatCompletionMessageParam, reply.model_dump(exclude_none=True)))
        if not reply.tool_calls:
            return grade(key, value, asked, reply.content)
        for call in reply.tool_calls:
            result, looked_up = lookup(call, key, value)
            asked += [looked_up] if looked_up is not None else []
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0  # no answer within TURNS calls


def lookup(
    call: ChatCompletionMessageToolCallUnion, key: str, value: str
) -> tuple[str, str | None]:
    """The tool's result for one call, and the key it looked up (None: not a lookup). A
    bad call gets an error the model can read, as a real tool answers."""
    if call.type != "function":  # a custom tool: this agent offers none
        return f"error: no tool named {call.custom.name!r}", None
    if call.function.name != "lookup":
        return f"error: no tool named {call.function.name!r}", None
    try:
        looked_up = str(json.loads(call.function.arguments)["key"])
    except (ValueError, KeyError, TypeError) as error:
        return f"error: {error}", None
    return (value if looked_up == key else NO_SUCH_KEY), looked_up


def grade(key: str, value: str, asked: list[str], answer: str | None) -> float:
    """The ladder: any lookup, the right key, then the value as the answer's first word.
    An answer counts only after the right lookup: without it, it is a guess."""
    if not asked:
        return 0.0
    if key not in asked:
        return 0.25
    words = (answer or "").split()
    return 1.0 if words and words[0] == value else 0.5


if __name__ == "__main__":
    from rlhf_env.agent import serve

    serve(run, host="0.0.0.0", port=8000)
