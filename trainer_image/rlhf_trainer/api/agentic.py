"""The spec's multi-turn sections: the environments a job talks to, and how its rollouts
use one (`generation.multiTurn`). See docs/concepts/environments.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, WithJsonSchema

from rlhf_trainer.api.cuts import CutPolicies
from rlhf_trainer.api.rules import Rule, SpecModel

# A DNS label, as Kubernetes names Services: the operator will name the environment's.
ENVIRONMENT_NAME = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"
URL = r"^https?://[^\s/]+(/\S*)?$"
CLASS_PATH = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
# A ConfigMap's name (a DNS-1123 subdomain) and one of its keys, as the API server checks.
CONFIG_MAP_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
CONFIG_MAP_KEY = r"^[-._a-zA-Z0-9]+$"

# The data column that picks a row's environment (else multiTurn.environment). It routes
# the row: the environment's session gets the row's other columns.
ENVIRONMENT_COLUMN = "environment"
# Where the operator mounts multiTurn.chatTemplateFrom's key in the Ray pods, as one file.
# Beside the spec's mount (/etc/rlhf), not in it: a read-only ConfigMap volume cannot
# hold another's mount point.
CHAT_TEMPLATE_MOUNT = "/etc/rlhf-chat-template"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Which part of an overlong environment message maxObservationTokens cuts.
ObservationTruncation = Literal["tail", "head", "middle"]

# What the renderer passes to transformers' apply_chat_template itself.
RENDERER_ARGUMENTS = frozenset(
    [
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "strftime_now",
    ]
)


def _not_the_renderers(
    kwargs: dict[str, bool | int | float | str],
) -> dict[str, bool | int | float | str]:
    taken = sorted(RENDERER_ARGUMENTS & kwargs.keys())
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the trainer, not a template argument")
    return kwargs


# A chat template's keyword arguments: names to plain values (booleans, numbers, strings).
# The CRD keeps the map open (a structural schema has no union of types); the trainer's
# validation refuses anything but such values, with the field's path.
TemplateKwargs = Annotated[
    dict[str, bool | int | float | str],
    AfterValidator(_not_the_renderers),
    WithJsonSchema({"type": "object", "additionalProperties": True, "maxProperties": 32}),
]


class EnvironmentConfig(SpecModel):
    """An environment server (the protocol of rlhf_env): one that runs at `url`, or a
    class that `python -m rlhf_env serve` serves (`serve`)."""

    # maxLength bounds the CEL rules' cost over the list (the API server estimates it).
    name: str = Field(pattern=ENVIRONMENT_NAME, max_length=40, description="How the job names it.")
    url: str | None = Field(
        None,
        pattern=URL,
        max_length=2048,
        description=(
            "Where it serves the environment protocol, with its scheme: "
            "http://lookup.team.svc:8000."
        ),
    )
    serve: str | None = Field(
        None,
        pattern=CLASS_PATH,
        description=(
            "An environment class in the trainer image, as module:Class "
            "(rlhf_env.toys:LetterLookup). A local run (rlhfjob train --local, make demo) "
            "serves it on this machine; in a cluster, give url."
        ),
    )

    rules: ClassVar[tuple[Rule, ...]] = (  # the operator's EnvironmentSpec replaces them
        Rule(
            "",
            "set exactly one of url or serve",
            "has(self.url) != has(self.serve)",
            lambda e: (e.url is None) != (e.serve is None),
        ),
    )


class ConfigMapKeyRef(SpecModel):
    name: str = Field(
        pattern=CONFIG_MAP_NAME,
        max_length=253,
        description="The ConfigMap, in the job's namespace.",
    )
    key: str = Field(
        pattern=CONFIG_MAP_KEY, max_length=253, description="The key whose value is the template."
    )


class ChatTemplateSource(SpecModel):
    """Where a chat template is kept, in place of the spec itself."""

    config_map_key_ref: ConfigMapKeyRef = Field(
        description=(
            f"A key of a ConfigMap, mounted read-only in the Ray pods (at "
            f"{CHAT_TEMPLATE_MOUNT}/{CHAT_TEMPLATE_FILE}) and read by the trainer."
        )
    )


class MultiTurnConfig(SpecModel):
    """Rollouts as conversations with an environment: the model's turns, parsed for tool
    calls, alternate with the environment's answers until it says the episode is done or a
    limit cuts it. A cut episode is counted, and masked or trained on as `cuts` says.

    The limits below are the job's, for every environment: they bound the batch's width
    and the engines' context (maxTokens), which one job has one of. An environment's own
    limits are its server's (the operator's environments[]: replicas, maxSessions,
    callTimeoutSeconds)."""

    environment: str | None = Field(
        None,
        max_length=40,
        description=(
            "The environments[] entry an episode runs in when its data row has no "
            f"`{ENVIRONMENT_COLUMN}` column (a row's column names another entry). Unset: "
            "every row must name one."
        ),
    )
    tool_parser: str = Field(
        "hermes",
        min_length=1,
        description=(
            "vLLM's tool parser that reads tool calls from the model's turns, as `vllm serve "
            "--tool-call-parser` names it (hermes, llama3_json, ...; rlhf_toy for the tiny "
            "models' `call X`)."
        ),
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        max_length=262_144,
        description=(
            "A Jinja chat template for the episodes, in place of the tokenizer's own (as "
            "vllm serve --chat-template takes one): e.g. a template with tool support for a "
            "model whose own has none. Unset: the tokenizer's. Its end-of-turn token is "
            "read from it (the special token after an assistant's answer). At most one of "
            "chatTemplate and chatTemplateFrom."
        ),
    )
    chat_template_from: ChatTemplateSource | None = Field(
        None,
        description=(
            "The chat template kept in a ConfigMap, {configMapKeyRef: {name, key}}, in place "
            "of chatTemplate (a long template, shared by jobs). A local run has no "
            "ConfigMap: it refuses this, and takes chatTemplate."
        ),
    )
    chat_template_kwargs: TemplateKwargs = Field(
        default_factory=dict,
        description=(
            "Keyword arguments of the chat template, as vLLM's chat_template_kwargs: "
            "{enable_thinking: false} for Qwen3 without thinking, {date_string: 26 Jul "
            "2024} for Llama 3's date. The date a template reads from strftime_now is the "
            "job's start, fixed for the whole run."
        ),
    )
    max_turns: int = Field(8, ge=1, le=256, description="Assistant turns per episode, at most.")
    max_tokens: int = Field(
        2048,
        ge=2,
        le=1_048_576,
        description=(
            "The episode's token budget: its prompt, every turn and every tool result. A turn "
            "samples at most data.maxResponseLength tokens of it."
        ),
    )
    max_observation_tokens: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description=(
            "Each message the environment returns (a tool result) keeps at most this many "
            "tokens of its content, and says how many it left out. Unset: whole, within "
            "maxTokens (an episode whose messages overflow it is cut, without them)."
        ),
    )
    observation_truncation: ObservationTruncation = Field(
        "tail",
        description=(
            "Which part of a message over maxObservationTokens is cut, at a marker that says "
            "how many tokens: tail (its first maxObservationTokens tokens kept), head (its "
            "last kept: a log's end, an error after output), or middle (half from each end)."
        ),
    )
    tool_call_timeout_seconds: float = Field(
        30.0, gt=0, le=3600, description="Each call to the environment (start, step, score)."
    )
    turn_timeout_seconds: float = Field(
        300.0, gt=0, le=86400, description="Each assistant turn's generation."
    )
    episode_timeout_seconds: float = Field(
        1800.0, gt=0, le=604800, description="The whole episode, tool calls included."
    )
    cuts: CutPolicies = Field(
        default_factory=CutPolicies,
        description=(
            "What a cut episode does, per reason: {maxTurns: {policy: train, score: -1}, "
            "environmentError: {policy: mask}}. Unset reasons: the policy's own overruns "
            "(maxTurns, tokenBudget, turnTimeout) are trained on with score 0; every other "
            "cut is masked (counted, never trained on)."
        ),
    )
    turn_reward_discount: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "Per-turn rewards (an environment step's reward) are added at each turn's last "
            "sampled token, on top of the final score: the k-th turn's (from 0) times this "
            "to the power k. 1: every turn's reward counts in full."
        ),
    )
    max_cut_ratio: float = Field(
        1.0,
        gt=0,
        le=1,
        description=(
            "A training step whose share of cut episodes reaches this counts against the "
            "job; maxCutSteps such steps in a row fail it (TooManyCuts, with the reasons). "
            "1: only steps whose every episode was cut."
        ),
    )
    max_cut_steps: int = Field(
        3,
        ge=1,
        le=10_000,
        description="Steps in a row at maxCutRatio or above that fail the job.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "chatTemplateFrom",
            "set at most one of chatTemplate or chatTemplateFrom",
            "!has(self.chatTemplate) || !has(self.chatTemplateFrom)",
            lambda m: m.chat_template is None or m.chat_template_from is None,
        ),
    )


def row_environment(
    row: Mapping[str, Any], multi_turn: MultiTurnConfig, declared: Sequence[str]
) -> str:
    """The environments[] entry a data row's episode runs in: its `environment` column,
    else multiTurn.environment. ValueError, saying what is wrong, when neither names a
    declared one (the data loader adds the row's number)."""
    name = row.get(ENVIRONMENT_COLUMN)
    names = ", ".join(declared) or "none"
    if name is None:
        if multi_turn.environment is None:
            raise ValueError(
                f"no column {ENVIRONMENT_COLUMN!r}, and generation.multiTurn.environment (the "
                f"default) is unset: name one of environments ({names}) in the row, or set it"
            )
        return multi_turn.environment
    if not isinstance(name, str) or name not in declared:
        raise ValueError(
            f"column {ENVIRONMENT_COLUMN!r}: expected one of environments ({names}), got {name!r}"
        )
    return name


def multi_turn_rules() -> tuple[Rule, ...]:
    """JobConfig's: generation.multiTurn's environments are declared (its default, and
    each data row's, checked at load: row_environment); their score is the reward."""
    multi_turn = "self.generation.multiTurn"
    environment = "has(self.models.reward.environment) && self.models.reward.environment"
    return (
        Rule(
            "environments",
            "environment names must be unique",
            "!has(self.environments) "
            "|| self.environments.all(e, self.environments.exists_one(f, f.name == e.name))",
            lambda c: len({e.name for e in c.environments}) == len(c.environments),
        ),
        Rule(
            "environments",
            "must declare at least one environment with generation.multiTurn (its "
            "episodes run in them)",
            f"!has({multi_turn}) || has(self.environments) && size(self.environments) > 0",
            lambda c: c.multi_turn is None or bool(c.environments),
        ),
        Rule(
            "generation.multiTurn.environment",
            "must name one of environments",
            f"!has({multi_turn}) || !has({multi_turn}.environment) || has(self.environments) "
            f"&& self.environments.exists(e, e.name == {multi_turn}.environment)",
            lambda c: (
                c.multi_turn is None
                or c.multi_turn.environment is None
                or any(e.name == c.multi_turn.environment for e in c.environments)
            ),
            lambda c: (
                f"got {c.multi_turn.environment!r}; declared: "
                + (", ".join(e.name for e in c.environments) or "none")
            ),
        ),
        Rule(
            "generation.multiTurn.maxTokens",
            "must exceed data.maxPromptLength (the episode's budget holds its prompt)",
            f"!has({multi_turn}) || {multi_turn}.maxTokens > self.data.maxPromptLength",
            lambda c: c.multi_turn is None or c.multi_turn.max_tokens > c.data.max_prompt_length,
        ),
        Rule(
            "models.reward.environment",
            "is required with generation.multiTurn, and allowed only there or with "
            "generation.agent (the reward is each episode's own: its environment's final "
            "score, or its agent's reward)",
            f"has({multi_turn}) ? {environment} : (!({environment}) || has(self.generation.agent))",
            lambda c: (
                c.models.reward.environment
                if c.multi_turn is not None
                else not c.models.reward.environment or c.generation.agent is not None
            ),
        ),
    )
