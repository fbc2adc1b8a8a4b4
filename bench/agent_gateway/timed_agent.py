"""examples/agents/letters_agent.py as the bench serves it: the same `run`, unchanged, with
each episode's seconds and its calls' seconds (the agent's view of the gateway: the HTTP
round trip, vLLM's OpenAI serving and the engine's sampling) appended as a JSON line to
the file TIMINGS_VARIABLE names. The agent's own loop (its tool, its grading, building
the messages) is an episode's seconds less its calls'.

Served by the job as any agent is (`agents[].serve`, `python -m rlhf_env agent`), in a
process of its own; the bench reads the file after the run.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import openai

# Imported by name: examples/ is not in the project's type check (its messages are
# plain dicts, which the openai package's types refuse), so mypy does not follow it.
letters_agent = importlib.import_module("examples.agents.letters_agent")

TIMINGS_VARIABLE = "RLHF_BENCH_AGENT_TIMINGS"


def timed(create: Callable[..., Awaitable[Any]], seconds: list[float]) -> Callable[..., Any]:
    """`create`, appending each call's seconds to `seconds`."""

    async def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await create(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    return call


async def run(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> float:
    """letters_agent.run, its episode and its calls timed."""
    calls: list[float] = []
    completions = client.chat.completions
    completions.create = timed(completions.create, calls)  # type: ignore[method-assign]
    started = time.time()
    try:
        reward: float = await letters_agent.run(task, client, model)
        return reward
    finally:
        ended = time.time()
        record = {"start": started, "end": ended, "calls": calls}
        with open(os.environ[TIMINGS_VARIABLE], "a") as timings:
            timings.write(json.dumps(record) + "\n")
