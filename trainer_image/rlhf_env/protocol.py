"""The environment protocol: HTTP and JSON between the trainer and an environment.

    POST   /sessions              {"row": {...}}            -> Started
    POST   /sessions/{id}/step    {"message": assistant}    -> Step
    POST   /sessions/{id}/score   (no body)                 -> Scored
    DELETE /sessions/{id}         (no body)                 -> 204
    GET    /healthz               (no body)                 -> Health
    GET    /livez                 (no body)                 -> Health, or 503 (not live)

It is the part that NeMo-Gym, skyrl-gym and OpenRLHF's agent API share: a session per
data row, messages in OpenAI's chat shape, tools in OpenAI's function-tool format. The
trainer owns the tokens; the environment sees and returns only messages. An error is
`{"detail": "..."}` with a status: 404 unknown session, 422 a body that breaks these
models, 500 the environment's own code failed, 503 no room for another session, 504 the
environment's code ran past the server's deadline. /livez is rlhf_env's server's own (a
liveness probe); a server of another make need answer only /healthz.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Self

from jsonschema import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ProtocolModel(BaseModel):
    # A misspelt field is refused (422), not silently dropped: both sides are ours.
    model_config = ConfigDict(extra="forbid")


class FunctionCall(ProtocolModel):
    """A call as the model wrote it: `arguments` stays a JSON string, as in OpenAI's API,
    because a model can write JSON that does not parse and the environment should say so
    in its tool message rather than the protocol refusing the turn."""

    name: str
    arguments: str = "{}"

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as an object; ValueError saying why when they are not one."""
        try:
            parsed = json.loads(self.arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"arguments are not JSON: {error}") from error
        if not isinstance(parsed, dict):
            raise ValueError(f"arguments must be a JSON object, got {self.arguments}")
        return parsed


class ToolCall(ProtocolModel):
    """One tool call of an assistant message; its `id` pairs it with the tool's answer."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(ProtocolModel):
    """A chat message in OpenAI's shape, so chat templates and tool parsers take it as is."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # assistant messages only
    tool_call_id: str | None = None  # tool messages only: the call this answers

    @model_validator(mode="after")
    def _calls_fit_the_role(self) -> Self:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id is required on tool messages and only there")
        return self


# OpenAI's rule for function names; chat templates put them in the prompt verbatim.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class ToolFunction(ProtocolModel):
    """A function the model may call: `parameters` is the JSON Schema of its arguments."""

    name: str = Field(pattern=TOOL_NAME)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None

    @model_validator(mode="after")
    def _parameters_are_a_schema(self) -> Self:
        # Checked here, not by the model's tokenizer: a bad schema would otherwise reach
        # the chat template and the trainer as a prompt that silently lacks the tool.
        problem = schema_problem(self.parameters)
        if problem:
            raise ValueError(f"tool {self.name!r}: parameters {problem}")
        return self


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why `schema` cannot describe a function's arguments, or None if it can."""
    validator = validator_for(schema, default=Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as error:
        where = "".join(f"[{part!r}]" for part in error.absolute_path) or " (the root)"
        return f"is not a valid JSON Schema: {error.message}, at parameters{where}"
    if schema.get("type") != "object":
        return f'must describe an object ("type": "object"), got type {schema.get("type")!r}'
    return None


class Tool(ProtocolModel):
    """A tool in OpenAI's function-tool format, the one chat templates render."""

    type: Literal["function"] = "function"
    function: ToolFunction


class StartRequest(ProtocolModel):
    """A data row, as the dataset holds it; only the environment reads it."""

    row: dict[str, Any]


class Start(ProtocolModel):
    """How a conversation opens: its first messages and the tools the model may call.
    An environment's `reset` returns it."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tool_names_are_unique(self) -> Self:
        names = [tool.function.name for tool in self.tools]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"tool names must be unique, these repeat: {twice}")
        return self


class Started(Start):
    """A new session: its id (for the calls that follow) and how it opens."""

    session: str


class StepRequest(ProtocolModel):
    """The policy's turn: one assistant message, its tool calls already parsed."""

    message: Message

    @model_validator(mode="after")
    def _from_the_assistant(self) -> Self:
        if self.message.role != "assistant":
            raise ValueError(f"a step takes an assistant message, got role {self.message.role}")
        return self


class Step(ProtocolModel):
    """The environment's turn: tool results (or a user's reply), a reward for this turn if
    the environment gives one per turn, and whether the episode is over. An environment's
    `step` returns it."""

    messages: list[Message]
    # A NaN or infinite reward would poison every gradient it touches: refused here.
    reward: float | None = Field(None, allow_inf_nan=False)
    done: bool = False


class Scored(ProtocolModel):
    """The episode's final score, the reward the trainer learns from."""

    score: float = Field(allow_inf_nan=False)


class Health(ProtocolModel):
    """What a readiness probe and a person both want to see."""

    status: Literal["ok"] = "ok"
    environment: str
    sessions: int


class ErrorBody(ProtocolModel):
    """Every error: FastAPI's shape. A 422's detail is its list of field errors."""

    detail: str | list[Any]


def describe(error: ValidationError) -> str:
    """A validation error in one line: `field.path: message; ...`."""
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)
