"""A decoder's shape, as its config.json gives it: what the memory estimate (api.memory)
and the cost model's LoRA sizing (api.estimate) count parameters from."""

from __future__ import annotations

from pydantic import Field

from rlhf_trainer.api.lora import LoraConfig
from rlhf_trainer.api.rules import SpecModel


class ModelShape(SpecModel):
    """A decoder's shape, from its config.json: what sizes its memory (api.memory) and
    a LoRA adapter on it (api.estimate). Biases are left out (a few per layer)."""

    layers: int = Field(ge=1, le=1024, description="Decoder layers (num_hidden_layers).")
    hidden_size: int = Field(ge=1, le=1_000_000, description="hidden_size.")
    intermediate_size: int = Field(
        ge=1, le=10_000_000, description="The MLP's width (intermediate_size)."
    )
    kv_size: int = Field(
        ge=1,
        le=1_000_000,
        description="num_key_value_heads x head_dim: k_proj's and v_proj's outputs.",
    )
    vocab_size: int = Field(ge=1, le=10_000_000, description="vocab_size.")
    tied_embeddings: bool = Field(
        False, description="tie_word_embeddings: the LM head is the input embeddings."
    )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each linear layer of a decoder layer by its name: (inputs, outputs)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.kv_size
        return {
            "q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip

    def adapter_parameters(self, lora: LoraConfig) -> int:
        """A LoRA adapter's parameters: A (r x in) and B (out x r) on each target."""
        shapes = self.linear_shapes()
        if unknown := sorted(set(lora.target_modules) - set(shapes)):
            raise ValueError(
                f"lora.targetModules {unknown}: the estimate sizes only {', '.join(shapes)}"
            )
        per_layer = sum(lora.rank * sum(shapes[name]) for name in set(lora.target_modules))
        return self.layers * per_layer

    @property
    def layer_parameters(self) -> int:
        """One decoder layer's: its linear layers and its two norms."""
        return sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden_size

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def parameters(self, lm_head: bool) -> int:
        """The whole model's: the layers, the embeddings and the final norm, with an LM
        head of its own when untied (`lm_head`), else a one-output head (a value head, a
        reward model's score)."""
        own_head = self.embedding_parameters if not self.tied_embeddings else 0
        head = own_head if lm_head else self.hidden_size + 1
        return (
            self.layers * self.layer_parameters
            + self.embedding_parameters
            + self.hidden_size
            + head
        )
