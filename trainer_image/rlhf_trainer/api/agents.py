"""The spec's agent sections: agents that own their loop and call the policy through an
OpenAI-compatible gateway of the rollout pool (`agents[]`), and how rollouts use one
(`generation.agent`). The contract an agent serves is rlhf_env.agent_protocol; see
docs/concepts/agents.md.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from rlhf_trainer.api.agentic import ENVIRONMENT_NAME, URL
from rlhf_trainer.api.cuts import AgentCutPolicies
from rlhf_trainer.api.rules import Rule, SpecModel

# An agent's entry point in its image: `python -m rlhf_env agent module:function` serves
# `async def run(task, client) -> float | None`.
FUNCTION_PATH = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
# Where each rollout engine's gateway listens, in its Ray pod: the agents' NetworkPolicy
# lets them reach this port of the rollout pool's pods and nothing else of the job's.
GATEWAY_PORT = 8100
# The name the gateway serves the policy under (/v1/models), whatever the model's path.
SERVED_MODEL = "policy"


class AgentConfig(SpecModel):
    """An agent service: one that runs at `url`, or a function that `python -m rlhf_env
    agent` serves (`serve`)."""

    name: str = Field(pattern=ENVIRONMENT_NAME, max_length=40, description="How the job names it.")
    url: str | None = Field(
        None,
        pattern=URL,
        max_length=2048,
        description=(
            "Where it serves the agent protocol (POST /episodes), with its scheme: "
            "http://coder.team.svc:8000."
        ),
    )
    serve: str | None = Field(
        None,
        pattern=FUNCTION_PATH,
        description=(
            "An agent function in the image, as module:function (async def run(task, "
            "client) -> float | None, client an openai.AsyncOpenAI): `python -m rlhf_env "
            "agent` serves it. A local run serves it on this machine; in a cluster the "
            "operator runs it as the job's own service."
        ),
    )
    max_concurrent_episodes: int = Field(
        16,
        ge=1,
        le=100_000,
        description=(
            "Episodes the trainer runs on this agent at once (each replica's share is this "
            "over the replicas). Past it new episodes wait."
        ),
    )

    rules: ClassVar[tuple[Rule, ...]] = (  # the operator's AgentSpec replaces them
        Rule(
            "",
            "set exactly one of url or serve",
            "has(self.url) != has(self.serve)",
            lambda a: (a.url is None) != (a.serve is None),
        ),
    )


class AgentEpisodes(SpecModel):
    """Rollouts as episodes of an agent that owns its loop: the trainer hands it a data
    row and a gateway URL and key; the gateway records every call's token ids, log-probs
    and weight versions. Calls whose prompt extends the last call's tokens are merged into
    one trajectory; the others are samples of their own, sharing the episode's reward,
    all trained on (up to maxSamplesPerEpisode)."""

    agent: str = Field(max_length=40, description="The agents[] entry each episode runs on.")
    tool_parser: str | None = Field(
        None,
        min_length=1,
        description=(
            "vLLM's tool parser for calls that offer tools (`vllm serve "
            "--tool-call-parser`: hermes, llama3_json, ...). Unset: tools are refused."
        ),
    )
    max_calls: int = Field(
        32, ge=1, le=10_000, description="Chat completions per episode; past it: cut."
    )
    max_call_tokens: int = Field(
        1024,
        ge=1,
        le=1_048_576,
        description="max_tokens of each call, at most (a call asking more is refused).",
    )
    episode_timeout_seconds: float = Field(
        1800.0, gt=0, le=604800, description="The whole episode; past it: cut."
    )
    call_discount: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "Samples of one episode that do not extend each other share its reward: the "
            "k-th from the last gets it times this to the power k (1: all in full)."
        ),
    )
    max_samples_per_episode: int = Field(
        4,
        ge=1,
        le=64,
        description=(
            "Samples an episode trains on, at most: the latest (by their last call); its "
            "earlier ones are counted (rlhf_agent_samples_left_out_total), not trained on. "
            "A step trains up to batchSize x samplesPerPrompt x this many, and the memory "
            "estimate counts that many rows."
        ),
    )
    cuts: AgentCutPolicies = Field(
        default_factory=AgentCutPolicies,
        description=(
            "What an episode cut at a limit does, per reason: {maxCalls: {policy: train, "
            "score: -1}}. Unset: masked (counted, never trained on). The agent's own "
            "faults (agent_error, agent_unreachable, agent_timeout, agent_protocol) are "
            "always masked."
        ),
    )


def agent_rules() -> tuple[Rule, ...]:
    """JobConfig's: agents[] names are unique, and generation.agent names one of them."""
    agents, episodes = "self.agents", "self.generation.agent"
    return (
        Rule(
            "agents",
            "agent names must be unique",
            f"!has({agents}) || {agents}.all(a, {agents}.exists_one(b, b.name == a.name))",
            lambda c: len({a.name for a in c.agents}) == len(c.agents),
        ),
        Rule(
            "generation.agent.agent",
            "must name one of agents",
            f"!has({episodes}) || has({agents}) && {agents}.exists(a, a.name == {episodes}.agent)",
            lambda c: (
                c.generation.agent is None
                or any(a.name == c.generation.agent.agent for a in c.agents)
            ),
            lambda c: (
                f"got {c.generation.agent.agent!r}; declared: "
                + (", ".join(a.name for a in c.agents) or "none")
            ),
        ),
        Rule(
            "generation.agent",
            "and generation.multiTurn are two ways to run episodes: set one",
            "!has(self.generation.agent) || !has(self.generation.multiTurn)",
            lambda c: c.generation.agent is None or c.generation.multi_turn is None,
        ),
    )
