"""What the trainer reports into the RLHFJob's status: its progress, and the last
evaluation on the held-out prompts (also a line of the run folder's eval.jsonl); and
the one part of the operator's status the trainer reads: the pools being resized."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from rlhf_trainer.api.rules import SpecModel


class EvalProgress(SpecModel):
    """One evaluation on the held-out prompts (data.eval)."""

    step: int = Field(ge=0, description="Steps trained when it ran (0: before training).")
    policy_version: int = Field(ge=0, description="The policy version that answered.")
    prompts: int = Field(ge=1, description="Held-out prompts scored.")
    samples_per_prompt: int = Field(ge=1, description="Responses per prompt (k of pass@k).")
    reward_mean: float = Field(description="Mean reward over every response.")
    pass_at_1: float = Field(
        ge=0, le=1, description="Share of responses that pass (reward >= passReward)."
    )
    pass_at_k: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Share of prompts with at least one passing response (k > 1 only).",
    )
    response_length_mean: float = Field(ge=0, description="Mean response length in tokens.")
    # Multi-turn jobs only (generation.multiTurn): how the held-out episodes went.
    tool_call_rate: float | None = Field(
        None, ge=0, le=1, description="Share of episodes with at least one tool call."
    )
    tool_calls_mean: float | None = Field(None, ge=0, description="Tool calls per episode.")
    cut_ratio: float | None = Field(
        None, ge=0, le=1, description="Share of episodes cut by a limit or an environment error."
    )


class OutputProgress(SpecModel):
    """The policy last written to output (spec.output), whole."""

    path: str = Field(description="The Hugging Face directory.")
    step: int = Field(ge=0, description="The step whose policy it holds.")
    dtype: str = Field(description="The weights' dtype.")
    adapter: bool = Field(
        False, description="Only the LoRA adapter (peft's format), served over the base model."
    )


class TrainingProgress(SpecModel):
    """Progress the trainer reports into the RLHFJob's status."""

    step: int = Field(0, ge=0, description="PPO steps completed.")
    total_steps: int = Field(0, ge=0, description="PPO steps to run.")
    samples_per_second: float | None = Field(None, ge=0, description="Recent throughput.")
    policy_version: int = Field(0, ge=0, description="Version of the policy being trained.")
    reward_mean: float | None = Field(None, description="Mean reward of the last step.")
    kl: float | None = Field(None, description="KL to the reference policy, last step.")
    kl_coef: float | None = Field(
        None, ge=0, description="The KL penalty's coefficient, last step (see klController)."
    )
    entropy: float | None = Field(None, description="The policy's entropy, last step.")
    actor_grad_norm: float | None = Field(
        None, description="The actor's gradient norm before clipping, last step."
    )
    critic_grad_norm: float | None = Field(
        None, description="The critic's gradient norm before clipping, last step."
    )
    explained_variance: float | None = Field(
        None, description="How much of the returns' variance the critic's values explain."
    )
    response_length_mean: float | None = Field(
        None, ge=0, description="Mean response length in tokens, last step."
    )
    truncated_ratio: float | None = Field(
        None, ge=0, le=1, description="Share of responses cut at maxResponseLength, last step."
    )
    turns_mean: float | None = Field(
        None, ge=0, description="Multi-turn: assistant turns per episode, last step."
    )
    cut_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description=(
            "Multi-turn: share of the last step's episodes cut by a limit or an environment "
            "error (masked: not trained on)."
        ),
    )
    last_checkpoint: str | None = Field(None, description="Path of the newest checkpoint.")
    output: OutputProgress | None = Field(
        None, description="The policy last written to output (spec.output): where, and its step."
    )
    eval: EvalProgress | None = Field(
        None, description="The last evaluation on the held-out prompts (data.eval)."
    )
    last_failed_sync: str | None = Field(
        None,
        description=(
            "The last weight sync that failed in this attempt, in a line: the engines, the "
            "phase (init, start, bucket, finish) and the bytes moved. The engines it names "
            "were replaced and the run went on (generation.maxEngineRestarts)."
        ),
    )
    failure: str | None = Field(
        None,
        description=(
            "Why the trainer's attempt failed, in a line (its error: a rank out of memory "
            "names the rank, its pool and the figure); cleared by the next attempt's "
            "first report."
        ),
    )


class PoolResize(SpecModel):
    """A pool whose size in the spec differs from the running attempt's. The operator
    writes it (status.resizing); the trainer stops at a step boundary when a pool it
    runs on is to change (loop.resize)."""

    model_config = ConfigDict(extra="ignore")  # written by an operator of another version

    pool: str = Field(description="Pool name.")
    from_replicas: int = Field(ge=1, description="Nodes the running attempt has.")
    to_replicas: int = Field(ge=1, description="Nodes the spec asks for: the next attempt's.")
