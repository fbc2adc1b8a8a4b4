"""LoRA RL in the spec: `models.actor.lora`, and what a job with it may ask for.

The actor trains a low-rank adapter (peft) on its frozen base; the rollout engines load
the base once and take each new adapter through vLLM's LoRA support. A critic may train
an adapter too (`models.critic.lora`), its value head whole.
Importable without torch, peft or vLLM (the operator imports it).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from rlhf_trainer.api.rules import Rule, SpecModel

# The values vLLM's engine accepts as `max_lora_rank` (vllm/config/lora.py, MaxLoRARanks
# in vLLM 0.32); an adapter of any rank up to the value the engine was built with loads.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

ModuleName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", min_length=1, max_length=100)
]


class LoraConfig(SpecModel):
    """Train a LoRA adapter on the frozen model instead of all its weights (peft)."""

    rank: int = Field(
        16,
        ge=1,
        description=(
            "The adapter's rank r; at most 512, the largest that vLLM's engines serve "
            "(max_lora_rank)."
        ),
    )
    alpha: int = Field(
        32, ge=1, le=100_000, description="LoRA's alpha: the update is scaled by alpha / rank."
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "Dropout on the adapter's input, for the critic's adapter. The actor runs "
            "without dropout (PPO's ratio compares the loss's forward with pi_old's, the "
            "ref's and the engines', none of which drop out): on models.actor.lora it is "
            "not applied (the job logs so)."
        ),
    )
    target_modules: list[ModuleName] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        max_length=64,
        description=(
            "Names of the linear layers inside the decoder layers that get an adapter "
            "(e.g. q_proj, v_proj, gate_proj); a job whose model has none of a name fails "
            "at start, naming those it has."
        ),
    )

    rules = (
        Rule(
            "rank",
            "must be at most 512, the largest max_lora_rank vLLM serves (one of "
            + ", ".join(map(str, VLLM_MAX_LORA_RANKS))
            + ")",
            f"self.rank <= {VLLM_MAX_LORA_RANKS[-1]}",
            lambda m: m.rank <= VLLM_MAX_LORA_RANKS[-1],
            lambda m: f"got {m.rank}",
        ),
    )


def engine_max_lora_rank(rank: int) -> int:
    """The `max_lora_rank` an engine is built with for an adapter of `rank`: the smallest
    value vLLM accepts that holds it (a larger one only wastes the engine's memory)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"models.actor.lora.rank {rank} is above vLLM's largest max_lora_rank "
        f"({', '.join(map(str, VLLM_MAX_LORA_RANKS))})"
    )


def lora_rules() -> tuple[Rule, ...]:
    """JobConfig's rules for LoRA: an adapter export needs an adapter."""
    return (
        Rule(
            "output.lora",
            "adapter needs models.actor.lora (an actor that trains all its weights has no "
            "adapter to write)",
            "!has(self.output) || !has(self.output.lora) || self.output.lora != 'adapter' "
            "|| has(self.models.actor.lora)",
            lambda c: (
                c.output is None or c.output.lora != "adapter" or c.models.actor.lora is not None
            ),
        ),
    )
