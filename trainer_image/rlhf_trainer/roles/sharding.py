"""FSDP2 for the training roles (actor, critic): shard a model over the role's ranks.

Each transformer decoder layer is one FSDP unit, and the root is the last: it holds
everything else (embeddings, final norm, LM or value head). A tied LM head shares its
weight with the embeddings; both live in the root unit, so the one parameter is sharded
once and stays shared. The same code runs at world size 1 (a mesh of one rank), so a
one-GPU role takes the path a larger one does.

All three functions are collectives over the default process group: every rank of the
role calls them, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

DECODER_LAYER_SUFFIX = "DecoderLayer"  # Qwen2DecoderLayer, LlamaDecoderLayer, ...


def data_parallel_mesh() -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by class: those Hugging Face keeps whole
    (`_no_split_modules`) or named `...DecoderLayer`. Works for a causal LM and for a
    `ValueModel` around a backbone alike."""
    unsplit: set[str] = set()
    for module in model.modules():
        unsplit.update(getattr(module, "_no_split_modules", None) or ())
    return [
        module
        for module in model.modules()
        if module is not model and _is_decoder_layer(type(module).__name__, unsplit)
    ]


def _is_decoder_layer(class_name: str, unsplit: set[str]) -> bool:
    return class_name in unsplit or class_name.endswith(DECODER_LAYER_SUFFIX)


def shard_model(model: nn.Module, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Apply FSDP2 (`fully_shard`) to every decoder layer, then to the root; in place.

    With a `compute_dtype` below fp32 (bf16), FSDP2's mixed precision: each layer's
    parameters are gathered and computed in that dtype, while the sharded master
    weights, the optimizer and the gradient reduction stay fp32.
    Returns the model (now an FSDP module whose parameters are DTensors) for chaining.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"no decoder layers found in {type(model).__name__}")
    mesh = data_parallel_mesh()
    precision = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype != torch.float32
        else MixedPrecisionPolicy()  # fp32 throughout: no casts at all
    )
    for layer in layers:
        _check_no_weight_shared_outside(model, layer)
        fully_shard(layer, mesh=mesh, mp_policy=precision)
    fully_shard(model, mesh=mesh, mp_policy=precision)
    _check_still_tied(model)
    return model


def load_from_rank0(sharded: nn.Module, loaded: nn.Module | None) -> None:
    """Fill a sharded model's freshly allocated (`to_empty`) shards with the weights of
    `loaded`, a whole copy that only rank 0 has (None on the other ranks): each rank
    receives only its shard. Buffers outside the state dict (the rotary embedding's
    `inv_freq`) are broadcast whole. A collective: every rank must call it."""
    state = loaded.state_dict() if loaded is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(sharded, state, options=options)
    source = dict(loaded.named_buffers()) if loaded is not None else {}
    for name, buffer in sharded.named_buffers():
        if loaded is not None:
            buffer.copy_(source[name])
        dist.broadcast(buffer, src=0)
    _check_still_tied(sharded)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's weights, unsharded, on the CPU, under their Hugging Face names:
    on rank 0; the other ranks get {}. A collective: every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    # On one CPU rank the "gathered, offloaded" tensors are the live parameters
    # themselves: copy those, or the snapshot changes with the next optimizer step.
    live = _storages(model)
    snapshot: dict[str, Tensor] = {}
    for name, value in state.items():
        tensor = _as_tensor(value)
        snapshot[name] = tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor
    return snapshot


def trained_weights(model: nn.Module) -> dict[str, Tensor]:
    """The weights that train (a LoRA'd model's adapter; every weight of one trained
    whole), unsharded, on the CPU, by their names, on every rank. A collective: each
    sharded one is gathered."""
    return {name: _whole(p) for name, p in model.named_parameters() if p.requires_grad}


def without_frozen(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict without its frozen parameters, under every name they have:
    torch's `ignore_frozen_params` keeps a tied one's second name (a LoRA'd model's LM
    head, tied to its frozen embedding)."""
    named = model.named_parameters(remove_duplicate=False)
    frozen = {name for name, parameter in named if not parameter.requires_grad}
    return {name: value for name, value in state.items() if name not in frozen}


def _whole(parameter: Tensor) -> Tensor:
    """A parameter's full value on the CPU, from its shard (a collective for a DTensor)."""
    value = parameter.detach()
    return (value.full_tensor() if isinstance(value, DTensor) else value).cpu().clone()


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Scale the gradients so their global L2 norm is at most max_norm; returns the
    norm before clipping (the same on every rank). With sharded (DTensor) gradients the
    norm is a DTensor: replicated (clipping all-reduced it already), so this rank's
    copy is the number, with no gather (`full_tensor` runs DTensor's redistribution
    machinery only to find nothing to do); any other placement is gathered."""
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        replicated = all(isinstance(p, Replicate) for p in norm.placements)
        norm = norm.to_local() if replicated else norm.full_tensor()
    return float(norm)


def _storages(model: nn.Module) -> set[int]:
    """Where this rank's parameters and buffers (its shards of them) live."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in model.state_dict().values())
    return {t.untyped_storage().data_ptr() for t in local if isinstance(t, Tensor)}


def _as_tensor(value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"a model state value is {type(value).__name__}, not a tensor")
    return value


def _check_no_weight_shared_outside(model: nn.Module, layer: nn.Module) -> None:
    # A weight shared between a layer and the rest of the model would be sharded twice
    # (once per unit) and the two copies would drift apart after the first step.
    inside = {id(p) for p in layer.parameters()}
    layer_modules = {id(m) for m in layer.modules()}
    for module in model.modules():
        if id(module) in layer_modules:
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in inside:
                raise ValueError(
                    f"{type(module).__name__}.{name} shares a weight with a "
                    f"{type(layer).__name__}: they cannot be in separate FSDP units"
                )


def _check_still_tied(model: nn.Module) -> None:
    # fully_shard swaps each module's parameters for DTensor ones; a tied pair must
    # come out as one parameter again, or the head and the embeddings train apart.
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    if get_input is None or get_output is None:
        return
    output = get_output()
    if output is not None and output.weight is not get_input().weight:
        raise RuntimeError("sharding untied the LM head from the input embeddings")
