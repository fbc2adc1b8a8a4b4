"""The policy's weights as a vLLM engine takes them: checkpoint (Hugging Face) names,
safetensors bytes across the process boundary, and the extension vLLM mixes into each
of its workers to reload them in place.

The worker reloads through vLLM's own loader (`reload_weights`, checkpoint format),
because on CPU the kernels repack parameters at start-up and a plain
`model.load_weights` afterwards is wrong. How the weights reach the engine's process
is `weight_sync`'s business; this module is the last hop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor, nn

EXTENSION = f"{__name__}.WeightSyncExtension"  # vLLM's worker_extension_cls


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
        if not (tied and name == "lm_head.weight")
    }


def serialize_weights(weights: Mapping[str, Tensor]) -> bytes:
    return save_safetensors({name: tensor.cpu() for name, tensor in weights.items()})


def payload_of(weights: Iterable[tuple[str, Tensor]] | bytes) -> bytes:
    """Weights as the engine's worker takes them: safetensors bytes."""
    return weights if isinstance(weights, bytes) else serialize_weights(dict(weights))


def deserialize_weights(payload: bytes) -> dict[str, Tensor]:
    return load_safetensors(payload)


class WeightSyncExtension:
    """Mixed into every vLLM worker (worker_extension_cls); called by collective_rpc."""

    def load_serialized_weights(self, payload: bytes) -> int:
        """Reload the model's weights in place from safetensors bytes; returns how many."""
        weights = deserialize_weights(payload)
        worker: Any = self  # the vLLM worker this class is mixed into
        worker.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        refresh_tied_lm_head(worker.model_runner.get_model())
        return len(weights)


def refresh_tied_lm_head(model: nn.Module) -> bool:
    """Re-derive a tied LM head's kernel state from the freshly loaded embeddings.

    The head shares its weight with the embeddings, so the reload fills it in place,
    but the checkpoint has no `lm_head.weight` and vLLM skips its post-load step. On
    CPU that step packs the weight for the GEMM kernel: without redoing it the head
    keeps computing logits with the old weights (measured: log-probs off by ~6 nats).
    Returns whether there was a tied head to refresh.
    """
    vllm_model: Any = model  # vLLM's module tree, typed loosely
    lm_head = getattr(vllm_model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    embeddings = vllm_model.get_submodule("model.embed_tokens")
    if lm_head is None or weight is None or weight.data_ptr() != embeddings.weight.data_ptr():
        return False
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return True
