"""Toy environments, small enough to read in a minute, for tests and first runs.

- Lookup: the row holds a small table and the key asked for; the `lookup` tool reads the
  table. Score 1 when the final answer is the key's value.
- Calculator: the row holds numbers to add; the `calculate` tool evaluates integer
  `+ - *` expressions. Score 1 when the final answer is their sum.
- LetterLookup: Lookup in single words, for the tiny models' vocabulary; graded (any
  call, the right key, the right answer), so a randomly initialised model earns some
  reward.

Both end the episode at the first assistant message without tool calls (the answer), and
answer a bad call (an unknown tool, arguments that do not parse) with a tool message that
says what is wrong, as a real tool would: the model should learn from it, not crash.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from rlhf_env.protocol import Message, Start, Step, Tool, ToolFunction

Handler = Callable[[dict[str, Any]], str]  # a tool: parsed arguments -> its result


def tool(name: str, description: str, argument: str, about: str) -> Tool:
    """A tool with one required string argument."""
    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string", "description": about}},
        "required": [argument],
    }
    return Tool(function=ToolFunction(name=name, description=description, parameters=parameters))


def answer_tool_calls(message: Message, handlers: dict[str, Handler]) -> list[Message]:
    """One tool message per call in `message`, in order."""
    answers = []
    for call in message.tool_calls:
        handler = handlers.get(call.function.name)
        try:
            if handler is None:
                raise ValueError(f"no tool named {call.function.name!r}")
            content = handler(call.function.parsed_arguments())
        except (ValueError, KeyError, TypeError) as error:
            content = f"error: {error}"
        answers.append(Message(role="tool", tool_call_id=call.id, content=content))
    return answers


class Lookup:
    """Row: `{"table": {"apple": "red", ...}, "key": "apple"}`."""

    def reset(self, row: dict[str, Any]) -> Start:
        self.table: dict[str, str] = {str(k): str(v) for k, v in row["table"].items()}
        self.expected = self.table[row["key"]]
        self.answer: str | None = None
        question = (
            f"What is the value of the key {row['key']!r}? Use the lookup tool, "
            "then reply with the value alone."
        )
        lookup = tool("lookup", "The value stored under a key.", "key", "the key to look up")
        return Start(messages=[Message(role="user", content=question)], tools=[lookup])

    def step(self, message: Message) -> Step:
        if not message.tool_calls:
            self.answer = (message.content or "").strip()
            return Step(messages=[], done=True)
        handlers: dict[str, Handler] = {"lookup": self._lookup}
        return Step(messages=answer_tool_calls(message, handlers))

    def score(self) -> float:
        return 1.0 if self.answer == self.expected else 0.0

    def _lookup(self, arguments: dict[str, Any]) -> str:
        key = str(arguments["key"])
        return self.table.get(key, f"no key {key!r} in the table")


# The operators `calculate` accepts: integer arithmetic without powers or division, so
# every result is an exact integer and no input can take long to evaluate.
OPERATORS: dict[type[ast.AST], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
MAX_EXPRESSION = 200  # characters: bounds the size of any product


def calculate(expression: str) -> int:
    """An integer expression of + - * and parentheses, evaluated without eval()."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {expression!r}") from error
    return evaluate(tree.body)


def evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # not bool, not float
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError(f"only integers, + - * and parentheses: not {ast.unparse(node)!r}")


class Calculator:
    """Row: `{"numbers": [12, 30, 7]}`; the answer is their sum.

    With `"call_reward": r` in the row, the first turn whose every call is a valid one
    (the calculate tool, an expression it evaluates) gets the per-turn reward r (a
    shaping reward, for a model that rarely calls tools); the score stays the answer's."""

    def reset(self, row: dict[str, Any]) -> Start:
        numbers = [int(n) for n in row["numbers"]]
        self.expected = sum(numbers)
        self.answer: str | None = None
        self.call_reward: float | None = float(row["call_reward"]) if "call_reward" in row else None
        question = (
            f"What is {' + '.join(map(str, numbers))}? Use the calculate tool, "
            "then reply with the number alone."
        )
        calculator = tool(
            "calculate", "Evaluates integer + - * expressions.", "expression", "e.g. 2 * (3 + 4)"
        )
        return Start(messages=[Message(role="user", content=question)], tools=[calculator])

    def step(self, message: Message) -> Step:
        if not message.tool_calls:
            self.answer = (message.content or "").strip()
            return Step(messages=[], done=True)
        handlers: dict[str, Handler] = {"calculate": lambda a: str(calculate(a["expression"]))}
        answers = answer_tool_calls(message, handlers)
        reward = None
        valid = not any((a.content or "").startswith("error:") for a in answers)
        if self.call_reward is not None and valid:
            reward, self.call_reward = self.call_reward, None  # the first valid turn only
        return Step(messages=answers, reward=reward)

    def score(self) -> float:
        return 1.0 if self.answer == str(self.expected) else 0.0


def first_word(text: str | None) -> str | None:
    """The first word of a message's content; None when it has none."""
    words = (text or "").split()
    return words[0] if words else None


NO_SUCH_KEY = "0"  # LetterLookup's answer to a wrong key: a word of the tiny vocabulary


class LetterLookup:
    """Row: `{"key": "c", "value": "x"}` (single letters): the tiny models' lookup task.

    The conversation opens with the key alone (`c`); the `lookup` tool answers the
    row's key with its value and any other key with "0". Rendered by the tiny chat
    template, an ideal episode reads `c = call c</s> result x = x</s>`.

    Score, a ladder whose every rung is within reach of the one below:
      0     no lookup;
      0.25  a lookup, of another key only;
      0.5   a lookup of the row's key;
      1     that, and an answer whose first word is the value.
    The answer counts only after the lookup of the row's key: the value is random per
    row, so an answer without it is a guess (1 in 8), and a guess earns nothing. Graded,
    because a random tiny model almost never does it all: it says "call" first about
    once in 64 turns, and GRPO needs rewards that differ within a group to learn from.
    The answer is judged by its first word, as the rlhf_toy parser reads a call by its
    first two: what follows is noise a tiny model need not learn to stop.
    """

    def reset(self, row: dict[str, Any]) -> Start:
        self.key, self.value = str(row["key"]), str(row["value"])
        self.called, self.asked_right_key = False, False
        self.answer: str | None = None
        lookup = tool("lookup", "The value stored under a key.", "key", "the key to look up")
        return Start(messages=[Message(role="user", content=self.key)], tools=[lookup])

    def step(self, message: Message) -> Step:
        if not message.tool_calls:
            self.answer = (message.content or "").strip()
            return Step(messages=[], done=True)
        return Step(messages=answer_tool_calls(message, {"lookup": self._lookup}))

    def score(self) -> float:
        if not self.called:
            return 0.0
        if not self.asked_right_key:
            return 0.25
        return 1.0 if first_word(self.answer) == self.value else 0.5

    def _lookup(self, arguments: dict[str, Any]) -> str:
        self.called = True
        if str(arguments["key"]) != self.key:
            return NO_SUCH_KEY
        self.asked_right_key = True
        return self.value
