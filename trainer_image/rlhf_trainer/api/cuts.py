"""What a cut episode does (`generation.multiTurn.cuts`, `generation.agent.cuts`): masked
(not trained on) or trained on with a given score, per reason. See
docs/concepts/environments.md and docs/concepts/agents.md."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from rlhf_trainer.api.rules import Rule, SpecModel

# Why an episode was cut, by kind (a cut's reason is its kind, then after a colon what
# happened). An environment's call fails as it could not be reached, sent no answer in
# time, answered with an error, or answered what breaks the protocol
# (rlhf_env.client.FailureKind); a chat template or a tool parser can fail on what the
# episode holds.
CUT_REASONS = (
    "max_turns",
    "token_budget",
    "turn_timeout",
    "episode_timeout",
    "environment_unreachable",
    "environment_timeout",
    "environment_error",
    "environment_protocol",
    "template_error",
    "tool_parser_error",
)
# The policy's own overruns: trained on by default, with a score of 0 (looping, or
# running long, earns no more than a wrong answer). The other reasons are faults of the
# environment, the template or the parser, or (episode_timeout) include the
# environment's time: masked by default.
TRAINED_BY_DEFAULT = frozenset({"max_turns", "token_budget", "turn_timeout"})

CutAction = Literal["mask", "train"]


class CutPolicy(SpecModel):
    """What a cut of one reason does."""

    policy: CutAction = Field(
        description=(
            "mask: the episode is counted, never trained on (its loss mask is all 0). "
            "train: its sampled turns are trained on, with `score` as its final reward."
        )
    )
    score: float | None = Field(
        None,
        ge=-1e6,
        le=1e6,
        description="The final reward of an episode trained on despite its cut (train only). "
        "Unset: 0.",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "score",
            "is the score of a cut trained on: set it only with policy train",
            "!has(self.score) || self.policy == 'train'",
            lambda p: p.score is None or p.policy == "train",
        ),
    )

    @property
    def trains(self) -> bool:
        return self.policy == "train"

    @property
    def reward(self) -> float:
        return self.score if self.score is not None else 0.0


def _policy_field(reason: str, when: str) -> Any:
    default = "train with score 0" if reason in TRAINED_BY_DEFAULT else "mask"
    return Field(None, description=f"Episodes cut ({reason}) when {when}. Unset: {default}.")


class PoliciesByReason(SpecModel):
    """A CutPolicy per cut reason: each field is a reason's, named by its kind."""

    def of(self, cut: str) -> CutPolicy:
        """The policy of a cut, given its reason ("environment_error: HTTP 500 ..."). A
        kind without a field here is masked: nothing is trained on that no policy allowed."""
        kind = cut.split(":", 1)[0]
        if kind not in type(self).model_fields:
            return CutPolicy(policy="mask")
        chosen: CutPolicy | None = getattr(self, kind)
        if chosen is not None:
            return chosen
        return CutPolicy(policy="train" if kind in TRAINED_BY_DEFAULT else "mask")


class CutPolicies(PoliciesByReason):
    """A policy per cut reason; a reason left unset keeps its default: the policy's own
    overruns (maxTurns, tokenBudget, turnTimeout) are trained on with score 0, every
    other cut masked."""

    max_turns: CutPolicy | None = _policy_field(
        "max_turns", "the environment asks for a turn past maxTurns"
    )
    token_budget: CutPolicy | None = _policy_field(
        "token_budget", "the episode's tokens fill maxTokens"
    )
    turn_timeout: CutPolicy | None = _policy_field(
        "turn_timeout", "a turn's generation outlasts turnTimeoutSeconds"
    )
    episode_timeout: CutPolicy | None = _policy_field(
        "episode_timeout", "the episode, tool calls included, outlasts episodeTimeoutSeconds"
    )
    environment_unreachable: CutPolicy | None = _policy_field(
        "environment_unreachable", "no replica of the environment can be reached"
    )
    environment_timeout: CutPolicy | None = _policy_field(
        "environment_timeout", "an environment call outlasts toolCallTimeoutSeconds"
    )
    environment_error: CutPolicy | None = _policy_field(
        "environment_error", "the environment answers with an error"
    )
    environment_protocol: CutPolicy | None = _policy_field(
        "environment_protocol", "the environment's answer breaks the protocol"
    )
    template_error: CutPolicy | None = _policy_field(
        "template_error", "the chat template fails on the episode's messages"
    )
    tool_parser_error: CutPolicy | None = _policy_field(
        "tool_parser_error", "the tool parser fails on a turn"
    )


class AgentCutPolicies(PoliciesByReason):
    """A policy for each limit the gateway cuts an agent episode at, all masked unless
    set. The agent's own faults (agent_error, agent_unreachable, agent_timeout,
    agent_protocol) have none: they are its code's, its pod's or its tools', not the
    policy's doing, and are always masked; so are agent_no_calls (nothing sampled) and
    agent_unjudged (no reward)."""

    max_calls: CutPolicy | None = _policy_field(
        "max_calls", "the agent makes a call past maxCalls (the policy kept calling)"
    )
    max_call_tokens: CutPolicy | None = _policy_field(
        "max_call_tokens", "a call asks for more than maxCallTokens"
    )
    episode_timeout: CutPolicy | None = _policy_field(
        "episode_timeout", "a call comes after episodeTimeoutSeconds (the agent's time too)"
    )
