"""The actor's LoRA adapter (peft): the base wrapped before sharding, and the adapter
as the files vLLM loads, for a weight sync.

The base is frozen (peft sets requires_grad=False on it), so the optimizer holds only
the adapter, and the ref can be the same base with the adapter off (`Actor.ref_log_probs`).
A sync gathers only the adapter's tensors whole: megabytes, not the model's gigabytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlhf_trainer.api.lora import LoraConfig
from rlhf_trainer.models import ValueModel
from rlhf_trainer.roles.sharding import decoder_layers, trained_weights
from rlhf_trainer.rollout.weight_sync import AdapterFiles


def linear_names(model: nn.Module) -> list[str]:
    """The distinct names of the linear layers inside the decoder layers: what
    targetModules may name (vLLM serves adapters on these, not on the embeddings)."""
    names = {
        name.rsplit(".", 1)[-1]
        for layer in decoder_layers(model)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) and name
    }
    return sorted(names)


def with_adapter(model: PreTrainedModel, lora: LoraConfig, role: str = "actor") -> PeftModel:
    """`model` frozen, with a fresh LoRA adapter on its `lora.target_modules` (B = 0: the
    model starts as the base). A name the model has no linear layer of fails, naming
    those it has (and `models.<role>.lora`)."""
    existing = linear_names(model)
    missing = [name for name in lora.target_modules if name not in existing]
    if missing:
        raise ValueError(
            f"models.{role}.lora.targetModules: {type(model).__name__} has no linear layer "
            f"named {', '.join(missing)} in its decoder layers; it has {', '.join(existing)}"
        )
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    return get_peft_model(model, config)


def adapted(
    load: Callable[[bool], PreTrainedModel], lora: LoraConfig
) -> Callable[[bool], nn.Module]:
    """`load` (see `trainable.prepare_trainable`) with the adapter added to what it builds."""
    return lambda weights: with_adapter(load(weights), lora)


def adapted_backbone(
    load: Callable[[bool], ValueModel], lora: LoraConfig
) -> Callable[[bool], ValueModel]:
    """`load` (a critic's) with the adapter on its backbone; the value head, new, trains
    whole."""

    def build(weights: bool) -> ValueModel:
        model = load(weights)
        model.backbone = with_adapter(model.backbone, lora, role="critic")
        return model

    return build


def adapter_files(model: nn.Module, dtype: torch.dtype, rank: int) -> AdapterFiles | None:
    """The adapter of a (sharded) PeftModel in peft's format, its tensors gathered whole
    and cast to `dtype` (the engines'): on rank 0; the others get None. A collective of
    the model's ranks (each adapter tensor is gathered)."""
    trained = trained_weights(model)
    if rank != 0:
        return None
    assert isinstance(model, PeftModel), type(model)
    return adapter_of(model, trained, dtype)


def adapter_of(model: PeftModel, trained: dict[str, Tensor], dtype: torch.dtype) -> AdapterFiles:
    """The adapter `trained` (its tensors by their names in `model`) in peft's format,
    in `dtype`: what vLLM's `add_lora` and peft's `PeftModel.from_pretrained` load."""
    cast = {name: tensor.to(dtype) for name, tensor in trained.items()}
    state = get_peft_model_state_dict(model, state_dict=cast, save_embedding_layers=False)
    config = model.peft_config["default"].to_dict()
    return AdapterFiles(
        config_json=json.dumps(config, default=sorted, sort_keys=True).encode(),  # sets: lists
        weights=safetensors_bytes({name: t.contiguous() for name, t in state.items()}),
    )


def with_trained_adapter(
    base: PreTrainedModel, lora: LoraConfig, trained: dict[str, Tensor], origin: str
) -> PeftModel:
    """`base` with the adapter `trained` (its tensors by their names in the LoRA'd model,
    as a checkpoint or the actor's gather holds them). `origin` names where they came
    from, in the error when they are not that adapter's whole."""
    model = with_adapter(base, lora)
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(expected - trained.keys()), sorted(trained.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{origin}: not the adapter of models.actor.lora (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    model.load_state_dict(trained, strict=False, assign=base.device.type == "meta")
    return model
