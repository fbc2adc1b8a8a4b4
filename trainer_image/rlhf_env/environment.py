"""What a user writes: a plain Python class, one instance per session.

    class Guess:
        '''Guess the row's number; the `guess` tool says higher or lower.'''

        def reset(self, row: dict) -> Start:
            self.secret, self.found = row["secret"], False
            return Start(
                messages=[Message(role="user", content="Guess my number, 1 to 10.")],
                tools=[Tool(function=ToolFunction(
                    name="guess",
                    parameters={"type": "object", "properties": {"n": {"type": "integer"}},
                                "required": ["n"]},
                ))],
            )

        def step(self, message: Message) -> Step:
            answers = []
            for call in message.tool_calls:
                n = call.function.parsed_arguments()["n"]
                self.found = self.found or n == self.secret
                verdict = "right" if n == self.secret else "higher" if n < self.secret else "lower"
                answers.append(Message(role="tool", tool_call_id=call.id, content=verdict))
            return Step(messages=answers, done=self.found or not message.tool_calls)

        def score(self) -> float:
            return 1.0 if self.found else 0.0

`python -m rlhf_env serve my_module:Guess` serves it (server.py). `reset` gets the data
row and opens the conversation; `step` gets each assistant message, tool calls parsed,
and answers it; `score` is the episode's reward, asked once the trainer is done with it;
`close`, if the class has one, frees what the session held. Any of them may be
`async def`; plain ones run in a worker thread, so a slow session does not hold up the
others. What `reset` and `step` return is validated: a tool schema that does not parse
fails the session with the tool's name and the reason.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

from rlhf_env.protocol import Message, Start, Step

REQUIRED_METHODS = ("reset", "step", "score")


class Environment(Protocol):
    """The class's shape. `close(self)` may be added; it is called when a session ends."""

    def reset(self, row: dict[str, Any]) -> Start | Awaitable[Start]: ...

    def step(self, message: Message) -> Step | Awaitable[Step]: ...

    def score(self) -> float | Awaitable[float]: ...


class NotAnEnvironment(ValueError):
    """`module:Class` names nothing that can serve sessions."""


def load_environment_class(target: str) -> type[Environment]:
    """The class that `module:Class` names; NotAnEnvironment saying what is wrong."""
    found = _load(target, "module:Class (e.g. my_envs:Lookup)")
    if not inspect.isclass(found):
        raise NotAnEnvironment(f"{target} is a {type(found).__name__}, expected a class")
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(found, name, None))]
    if missing:
        raise NotAnEnvironment(
            f"{target} is not an environment: it lacks {', '.join(missing)} "
            f"(an environment has {', '.join(REQUIRED_METHODS)})"
        )
    return cast("type[Environment]", found)  # its methods are checked above


def load_function(target: str) -> Callable[..., float]:
    """The function that `module:function` names (a reward: serve-reward)."""
    found = _load(target, "module:function (e.g. my_rewards:score)")
    if inspect.isclass(found) or not callable(found):
        raise NotAnEnvironment(f"{target} is a {type(found).__name__}, expected a function")
    return cast("Callable[..., float]", found)


def _load(target: str, expected: str) -> Any:
    """What `module:name` names, imported; NotAnEnvironment saying what is wrong."""
    module_name, colon, name = target.partition(":")
    if not colon or not module_name or not name:
        raise NotAnEnvironment(f"expected {expected}, got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a user's module may fail in any way while importing
        raise NotAnEnvironment(
            f"cannot import module {module_name!r} (from {target!r}): "
            f"{type(error).__name__}: {error}"
        ) from error
    found = getattr(module, name, None)
    if found is None:
        raise NotAnEnvironment(f"module {module_name!r} has no attribute {name!r}")
    return found
