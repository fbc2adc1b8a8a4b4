"""models.reward: where a job's reward comes from (a reward model, a function, a reward
service or an environment), and how a reward service is called."""

from __future__ import annotations

import json
import re

from pydantic import Field

from rlhf_trainer.api.agentic import CONFIG_MAP_NAME, URL
from rlhf_trainer.api.names import REWARD_FILES_MOUNT
from rlhf_trainer.api.rules import Rule, SpecModel

# models.reward.function: a built-in name, `module:function`, or anything that starts
# with `file:`, whose form the rule below checks with a message of its own.
REWARD_FUNCTION_PATTERN = r"^([A-Za-z_][\w.]*(:[A-Za-z_]\w*)?|file:.*)$"
FILE_PREFIX = "file:"
# file:NAME.py:FUNCTION: NAME.py a ConfigMap key (at most 253 characters), FUNCTION a
# Python identifier.
FILE_FUNCTION = r"^file:[-._a-zA-Z0-9]{1,250}\.py:[A-Za-z_][A-Za-z0-9_]*$"
# `function` is a CEL reserved word: the API server names the property `__function__`.
# (Spelled `self.function`, it is untyped there: matches() on it has no length bound and
# its estimated cost is 100x over the budget.)
FUNCTION = "self.__function__"
IS_FILE = f"{FUNCTION}.startsWith('{FILE_PREFIX}')"


class RewardRequests(SpecModel):
    """How the trainer calls a reward service (models.reward.url)."""

    timeout_seconds: float = Field(30.0, gt=0, le=3600, description="Each request's deadline.")
    retries: int = Field(
        3,
        ge=0,
        le=20,
        description=(
            "Tries again after a timeout, a refused connection, a 5xx or a 429, with "
            "exponential backoff from 0.5 s."
        ),
    )
    concurrency: int = Field(8, ge=1, le=1024, description="Requests in flight at once, at most.")
    batch_size: int = Field(
        64,
        ge=1,
        le=65536,
        description="Samples a request, at most. Samples are sent as they finish, "
        "spread over the requests that `concurrency` leaves free; those that finish while "
        "none is free wait, and go together when one is.",
    )
    max_unscored_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description=(
            "A request that still fails after its retries leaves its samples unscored: "
            "they are not trained on, and are counted. The job fails, naming the URL, once "
            "this many steps in a row had unscored samples."
        ),
    )


def is_file_function(function: str | None) -> bool:
    """Whether models.reward.function names a Python file (`file:NAME.py:FUNCTION`)."""
    return function is not None and function.startswith(FILE_PREFIX)


def file_function(function: str) -> tuple[str, str]:
    """`file:score.py:score` -> ("score.py", "score")."""
    file_name, _, name = function.removeprefix(FILE_PREFIX).rpartition(":")
    return file_name, name


class RewardSource(SpecModel):
    """The reward: a reward model, a rule-based function of the prompt and response, a
    reward service, or a multi-turn episode's environment."""

    path: str | None = Field(
        None, min_length=1, description="A reward model checkpoint (local directory or hub id)."
    )
    function: str | None = Field(
        None,
        pattern=REWARD_FUNCTION_PATTERN,
        max_length=512,  # bounds the CEL rules' cost (the API server estimates it)
        description=(
            "A rule-based reward: a built-in name ('toy_copy', or 'math_answer': the last "
            "number of the response against the row's answer column), 'module:function' "
            "importable in the trainer image, or 'file:NAME.py:FUNCTION', a function in the "
            "file NAME.py of configMap (mounted at "
            f"{REWARD_FILES_MOUNT}; a local run reads it from the manifest's directory). "
            "Called as f(prompt, response, **the row's other columns) -> float."
        ),
    )
    config_map: str | None = Field(
        None,
        pattern=CONFIG_MAP_NAME,
        max_length=253,
        description=(
            "The ConfigMap, in the job's namespace, that holds the file of a "
            "'file:NAME.py:FUNCTION' reward (kubectl create configmap NAME --from-file="
            f"score.py); mounted read-only at {REWARD_FILES_MOUNT} in the Ray pods."
        ),
    )

    environment: bool = Field(
        False,
        description=(
            "The reward is each episode's own: its environment's final score "
            "(generation.multiTurn), or the reward its agent returned (generation.agent)."
        ),
    )
    url: str | None = Field(
        None,
        pattern=URL,
        max_length=2048,
        description=(
            "A reward service, with its scheme (http://scorer.team.svc:8000): batches of "
            "{prompt, response, row} in, rewards out (`python -m rlhf_env serve-reward "
            "module:function` serves a reward function)."
        ),
    )
    requests: RewardRequests | None = Field(
        None, description="How url is called (defaults when unset)."
    )

    rules = (
        Rule(
            "",
            "set exactly one of path, function, environment or url",
            f"(has(self.path) ? 1 : 0) + (has({FUNCTION}) ? 1 : 0) "
            "+ (has(self.environment) && self.environment ? 1 : 0) + (has(self.url) ? 1 : 0) == 1",
            lambda m: (
                (m.path is not None)
                + (m.function is not None)
                + m.environment
                + (m.url is not None)
                == 1
            ),
        ),
        Rule(
            "requests",
            "only with url",
            "!has(self.requests) || has(self.url)",
            lambda m: m.requests is None or m.url is not None,
        ),
        Rule(
            "function",
            "a file: reward is 'file:NAME.py:FUNCTION', NAME.py a ConfigMap key (letters, "
            "digits, '-', '_' and '.') and FUNCTION a Python identifier",
            f"!has({FUNCTION}) || !{IS_FILE} || {FUNCTION}.matches({json.dumps(FILE_FUNCTION)})",
            lambda m: (
                not is_file_function(m.function)
                or re.fullmatch(FILE_FUNCTION, m.function) is not None
            ),
            lambda m: f"got {m.function!r}",
        ),
        Rule(
            "configMap",
            "a file: reward needs the ConfigMap that holds the file",
            f"!has({FUNCTION}) || !{IS_FILE} || has(self.configMap)",
            lambda m: not is_file_function(m.function) or m.config_map is not None,
        ),
        Rule(
            "configMap",
            "only with a file: function (configMap holds the reward's file)",
            f"!has(self.configMap) || (has({FUNCTION}) && {IS_FILE})",
            lambda m: m.config_map is None or is_file_function(m.function),
        ),
    )
