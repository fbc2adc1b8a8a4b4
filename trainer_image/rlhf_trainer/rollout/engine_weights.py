"""The policy's weights as a vLLM engine takes them: checkpoint (Hugging Face) names,
without a tied LM head, and the LM head's refresh after a reload. How they reach the
engine is `transfer_engines`' business."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn


def rollout_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The weights to send to the engine, in checkpoint (Hugging Face) names."""
    config = getattr(model, "config", None)
    return engine_weights(model.state_dict(), bool(getattr(config, "tie_word_embeddings", False)))


def engine_weights(state: Mapping[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """A causal LM's state dict as the engine loads it.

    With tied embeddings `lm_head.weight` is the embedding matrix again, and vLLM's
    loader has no separate parameter for it, so it is left out.
    """
    return {
        name: tensor.detach().contiguous()
        for name, tensor in state.items()
        if is_engine_weight(name, tied)
    }


def is_engine_weight(name: str, tied: bool) -> bool:
    return not (tied and name == "lm_head.weight")


def refresh_tied_lm_head(model: nn.Module) -> bool:
    """Re-derive a tied LM head's kernel state from the freshly loaded embeddings.

    The head shares its weight with the embeddings, so the reload fills it in place,
    but the checkpoint has no `lm_head.weight` and vLLM skips its post-load step. On
    CPU that step packs the weight for the GEMM kernel: without redoing it the head
    keeps computing logits with the old weights (measured: log-probs off by ~6 nats).
    The reload already ran the embeddings' own post-load step, which packs the same
    weight for the same kernel (`cpu_linear`, which uses nothing else of its layer): the
    head takes that one rather than pack it again (a 98 MB head: ~60 ms of a ~0.5 s
    sync, bench/README.md). Returns whether there was a tied head to refresh.
    """
    vllm_model: Any = model  # vLLM's module tree, typed loosely
    lm_head = getattr(vllm_model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    embeddings = vllm_model.get_submodule("model.embed_tokens")
    if lm_head is None or weight is None or weight.data_ptr() != embeddings.weight.data_ptr():
        return False
    packed = getattr(embeddings, "cpu_linear", None)
    if packed is not None:
        lm_head.cpu_linear = packed
    else:
        lm_head.quant_method.process_weights_after_loading(lm_head)
    return True
