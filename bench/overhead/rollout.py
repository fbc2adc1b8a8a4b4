"""The rollout ratio: tokens/s of a fully-async job's rollout pool against vLLM's own
`LLM.generate`, on the same requests (prompts, seeds, response cap) and engine settings.

    job    the run's engine (a Ray actor, AsyncLLM, `StreamingRollout`): the requests
           admitted through the run's `Admissions`, each sample streamed into the
           queue as it finishes; timed from the admission until the trainer holds them
           all (`take_groups`), as the async step takes its batch
    vllm   `vllm.LLM` in a process of its own, built from the same `engine_settings`,
           given the same requests with the same sampling parameters in one
           `generate` call, timed by its own clock
    async_llm
           the job's own `RolloutEngine` (vLLM's `AsyncLLM`) in a process of its own,
           a coroutine per request: what vLLM's async engine costs, apart from our
           Ray actors, streaming and queue

Nothing trains while either generates, and no weights are pushed: on 2 cores a rank
that trains takes the engine's CPU, which is the machine's cost, not our machinery's.
The weight push is timed apart (training.py). Both sides count the tokens they
generated; with the same seeds the responses are the same, up to batching numerics.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

from bench.harness import Measurement
from bench.overhead.cpu import tree_cpu_by_part
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.loop.fully_async import AsyncPPOTrainer
from rlhf_trainer.models import model_path
from rlhf_trainer.rollout.engine import EngineOptions, RolloutEngine
from rlhf_trainer.rollout.engine_settings import (
    engine_settings,
    platform_in_environment,
    sampling_params,
)
from rlhf_trainer.rollout.queue import Admitted
from rlhf_trainer.rollout.samples import Sample
from rlhf_trainer.worker import derive_seed


@dataclass(frozen=True)
class Requests:
    """One measurement's requests, the same for the job and for bare vLLM."""

    uids: list[int]
    prompt_indices: list[int]
    prompts: list[list[int]]  # token ids
    seeds: list[int]  # as the streaming rollout seeds sample `uid`


class JobRollout:
    """The job's rollout pool, fed `prompts` prompts (samplesPerPrompt each) a measurement."""

    def __init__(
        self, streaming: AsyncPPOTrainer, prompts: int, cpu: Callable[[], dict[str, float]]
    ) -> None:
        self.streaming = streaming
        self.cpu = cpu  # the job's processes' CPU-seconds so far, by part (cpu.PARTS)
        self.prompts = prompts
        self.next_prompt = streaming.admission.admitted_total  # run.start() admitted these
        self.last: Requests | None = None  # what the last measurement generated

    def first_samples(self) -> list[Sample]:
        """The samples of run.start()'s admission (the engine's warm-up), once queued."""
        samples: list[Sample] = self.streaming.take_groups(self.next_prompt)
        return samples

    def next_requests(self) -> Requests:
        streaming, n = self.streaming, self.streaming.group_size
        indices = streaming.prompts.next_indices(self.prompts)
        first, self.next_prompt = self.next_prompt, self.next_prompt + self.prompts
        uids = [(first + i) * n + j for i in range(self.prompts) for j in range(n)]
        seed = streaming.config.trainer.seed
        return Requests(
            uids=uids,
            prompt_indices=[index for index in indices for _ in range(n)],
            prompts=[
                streaming.prompts.prompts[index].token_ids for index in indices for _ in range(n)
            ],
            seeds=[derive_seed(seed, "sample", uid) for uid in uids],
        )

    def measure(self) -> Measurement:
        streaming = self.streaming
        requests = self.last = self.next_requests()
        admitted: list[Admitted] = list(
            zip(requests.uids, requests.prompt_indices, requests.prompts, strict=True)
        )
        started, cpu = time.perf_counter(), self.cpu()
        streaming.admissions.give(admitted)
        samples = streaming.take_groups(self.prompts)
        seconds, parts = time.perf_counter() - started, self.cpu()
        streaming.admissions.wait_for_admissions(60)  # answered long ago: only the futures
        tokens = sum(len(s.rollout.response_token_ids) for s in samples)
        spent = {part: parts[part] - cpu[part] for part in parts}
        return {
            **figures(tokens, len(samples), seconds, sum(spent.values())),
            **{f"cpu_s.{part}": cpu_s for part, cpu_s in spent.items()},
        }


class BareVLLM:
    """A bare engine (`serve_bare_vllm`) on the job's engine settings (`engine_settings`),
    in a process of its own that starts with the environment the job's engine core
    starts with, as that core does. (Built in the bench's own process, after Ray and
    torch, `LLM` ran 12x slower; the cause was not isolated.) Its own clock times each
    generation."""

    def __init__(self, config: JobConfig, engine: str = "llm") -> None:
        # Sets vLLM's environment here, for the child: start processes meant to run
        # without it (the bare torch ranks) before this.
        platform_in_environment(config.generation.tensor_parallel_size)
        context = mp.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=serve_bare_vllm, args=(config, engine, theirs))
        self.process.start()
        theirs.close()  # the child's end: if it dies, recv raises rather than waits
        self.pipe.recv()  # built

    def measure(self, requests: Requests) -> Measurement:
        pid = self.process.pid
        assert pid is not None, "started"
        cpu = tree_cpu_by_part(pid)  # with AsyncLLM, its engine core's process too
        self.pipe.send(requests)
        tokens, samples, seconds = self.pipe.recv()
        after = tree_cpu_by_part(pid)
        client, core = (after[p] - cpu[p] for p in ("driver", "engine_core"))
        return {
            **figures(tokens, samples, seconds, sum(after.values()) - sum(cpu.values())),
            "cpu_s.client": client,  # this process: LLM, or AsyncLLM's client
            "cpu_s.engine_core": core,  # AsyncLLM's engine core (LLM's runs in the client)
        }

    def close(self) -> None:
        self.pipe.send(None)
        self.process.join(timeout=30)


def serve_bare_vllm(config: JobConfig, engine: str, pipe: Connection) -> None:
    """The bare engine's process: build it, then generate each `Requests` sent, all at
    once, answering (tokens, samples, seconds). `engine`: "llm", vLLM's `LLM` (one
    `generate` call); "async_llm", the job's own `RolloutEngine` (vLLM's `AsyncLLM`, a
    request a coroutine, as the streaming rollout sends them) without Ray or the queue."""
    options = EngineOptions.of(config)
    model = model_path(config.models.actor, config.trainer.seed)  # the job's weights
    async_engine = RolloutEngine(model, **asdict(options)) if engine == "async_llm" else None
    if async_engine is None:
        generate = llm_generate(config, model, options)
    else:
        generate = async_llm_generate(config, async_engine)
    pipe.send("ready")
    try:
        while (requests := pipe.recv()) is not None:
            started = time.perf_counter()
            lengths = generate(requests)
            seconds = time.perf_counter() - started
            pipe.send((sum(lengths), len(lengths), seconds))
    finally:
        # AsyncLLM's engine core is a child: left running, this process never exits.
        if async_engine is not None:
            async_engine.shutdown()


def llm_generate(
    config: JobConfig, model: str, options: EngineOptions
) -> Callable[[Requests], list[int]]:
    """vLLM's `LLM`: the requests in one `generate` call; the response lengths."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    settings = asdict(options)
    settings["own_tokenizer"] = settings.pop("gateway")  # as RolloutEngine passes it
    llm = LLM(**engine_settings(model, **settings), disable_log_stats=True)
    generation, cap = config.generation, config.data.max_response_length

    def generate(requests: Requests) -> list[int]:
        params = [
            sampling_params(cap, generation.temperature, generation.top_p, seed)
            for seed in requests.seeds
        ]
        prompts: list[Any] = [TokensPrompt(prompt_token_ids=p) for p in requests.prompts]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    return generate


def async_llm_generate(config: JobConfig, engine: RolloutEngine) -> Callable[[Requests], list[int]]:
    """The job's `RolloutEngine`: a coroutine per request, as `StreamingRollout` starts
    them; the response lengths."""
    generation, cap = config.generation, config.data.max_response_length

    async def one(uid: int, prompt: list[int], seed: int) -> Rollout:
        return await engine.generate(
            str(uid),
            prompt,
            max_tokens=cap,
            temperature=generation.temperature,
            top_p=generation.top_p,
            seed=seed,
        )

    async def all_of(requests: Requests) -> list[Rollout]:
        ones = zip(requests.uids, requests.prompts, requests.seeds, strict=True)
        return list(await asyncio.gather(*(one(*request) for request in ones)))

    return lambda requests: [len(r.response_token_ids) for r in engine.call(all_of(requests))]


def figures(tokens: int, samples: int, seconds: float, cpu_s: float) -> Measurement:
    return {
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / cpu_s,
        "seconds": seconds,
        "cpu_s": cpu_s,
        "response_tokens": tokens / samples,
    }


def requests_of(streaming: AsyncPPOTrainer, samples: Sequence[Sample]) -> Requests:
    """The requests that generated `samples` (to warm bare vLLM up on the job's warm-up)."""
    seed = streaming.config.trainer.seed
    return Requests(
        uids=[s.uid for s in samples],
        prompt_indices=[s.prompt_index for s in samples],
        prompts=[streaming.prompts.prompts[s.prompt_index].token_ids for s in samples],
        seeds=[derive_seed(seed, "sample", s.uid) for s in samples],
    )
