"""Benchmark: the actor's update on one GPU, in bf16, against fp32 and against a plain
torch.autocast loop on the same model: MFU, tokens/s and peak memory.

    actor_bf16  the trainer's own Actor (roles/policy.py): FSDP2 at world size 1, bf16
                parameters and compute, fp32 master weights and gradient reduction,
                AdamW, the clipped PPO loss with entropy and importance weights
    actor_fp32  the same in fp32
    autocast    a plain loop on the same model: fp32 parameters, the forward pass under
                torch.autocast(bf16), the same policy loss, backward, AdamW; no FSDP
    autocast_compiled
                the same with each decoder layer torch.compile'd (one graph a layer:
                dynamo's cache is raised past the layer count, or it falls back to
                eager after 8); on a GPU only by default (on CPUs it compiles C++)

On a GPU the model is a ~0.5B-parameter Qwen2 built in code (hidden 1024, 28 layers,
vocab 32768) and each sequence is 2048 tokens (512 prompt, 1536 response).
MFU = 6 · parameters · tokens / seconds / the GPU's peak dense bf16 FLOP/s; it leaves
out attention's own FLOPs, so it errs low. Without a GPU the bench runs a tiny config
on the CPU and says that no GPU figure was taken.

Each variant runs in a process of its own (a fresh process group and a clean peak
memory), interleaved, 3 repeats: `make bench-gpu-train-step`, or with torch,
transformers and pydantic only: `PYTHONPATH=trainer_image python -m bench.gpu_train_step.run
[VARIANT ...]` (all three by default).
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.harness import Measurement, run_bench
from rlhf_trainer.algo.experience import Experience, Sequences
from rlhf_trainer.algo.ppo import clipped_policy_loss
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.roles.policy import Actor, policy_outputs
from rlhf_trainer.roles.trainable import load_policy
from rlhf_trainer.worker import RankInfo, free_port, init_distributed

REPEATS = 3
TIMED_UPDATES = 3  # after one warm-up update
# Peak dense bf16 tensor FLOP/s, by the name CUDA reports.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    vocab: int
    sequences: int  # per update
    prompt: int  # tokens per sequence
    response: int
    micro_batch: int


GPU = Shape(
    hidden=1024,
    layers=28,
    heads=16,
    vocab=32768,
    sequences=16,
    prompt=512,
    response=1536,
    micro_batch=4,
)
CPU = Shape(
    hidden=128, layers=2, heads=4, vocab=512, sequences=8, prompt=32, response=96, micro_batch=4
)


def job(shape: Shape, precision: str) -> JobConfig:
    """A critic-free job without a ref, so the actor alone is what runs."""
    tiny = {
        "hiddenSize": shape.hidden,
        "numLayers": shape.layers,
        "numHeads": shape.heads,
        "vocabSize": shape.vocab,
    }
    data = {"train": "toy:copy", "maxPromptLength": shape.prompt,
            "maxResponseLength": shape.response}  # fmt: skip
    return JobConfig.model_validate(
        {
            "pools": [{"name": "gpu", "replicas": 1, "gpusPerNode": 1}],
            "roles": {"actor": "gpu", "rollout": "gpu"},
            "models": {"actor": {"tiny": tiny}, "reward": {"function": "math_answer"}},
            "data": data,
            "algorithm": {"klCoef": 0, "advantageEstimator": "grpo"},
            "generation": {"samplesPerPrompt": 2},
            "trainer": {
                "precision": precision,
                "batchSize": shape.sequences // 2,
                "miniBatchSize": shape.sequences,
                "microBatchSize": shape.micro_batch,
            },
        }
    )


def experience(shape: Shape, log_probs: Callable[[Sequences], Tensor]) -> Experience:
    """Random sequences, scored by the model itself as the actor would have, with a
    random advantage per sequence; on the CPU, as Ray hands them to a role."""
    total = shape.prompt + shape.response
    ids = torch.randint(0, shape.vocab, (shape.sequences, total))
    response = torch.zeros(shape.sequences, total)
    response[:, shape.prompt :] = 1.0
    versions = torch.zeros(shape.sequences, dtype=torch.long)
    unscored = Sequences(ids, torch.ones_like(ids), response, torch.zeros_like(response), versions)
    old = log_probs(unscored)
    scored = Sequences(ids, torch.ones_like(ids), response, old, versions)
    advantages = torch.randn(shape.sequences, 1) * response
    return Experience.of(scored, old_log_probs=old, advantages=advantages)


def timed(update: Callable[[], object]) -> float:
    """Seconds per update, over TIMED_UPDATES after a warm-up one."""
    update()
    synchronize()
    started = time.perf_counter()
    for _ in range(TIMED_UPDATES):
        update()
    synchronize()
    return (time.perf_counter() - started) / TIMED_UPDATES


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def actor_seconds(shape: Shape, precision: str) -> tuple[float, int]:
    """The trainer's Actor, FSDP2 at world size 1: seconds per update, parameters."""
    info = RankInfo(Role.ACTOR, "gpu", rank=0, world_size=1)
    init_distributed(info, "127.0.0.1", free_port())
    actor = Actor(info, job(shape, precision))
    batch = experience(shape, actor.log_probs)
    steps = iter(range(1_000_000))
    seconds = timed(lambda: actor.update(batch, next(steps)))
    return seconds, sum(p.numel() for p in actor.model.parameters())


def autocast_seconds(shape: Shape, compiled: bool = False) -> tuple[float, int]:
    """A plain loop on the same model: fp32 parameters, bf16 autocast, AdamW; `compiled`:
    each decoder layer torch.compile'd."""
    config = job(shape, "fp32")
    device = RankInfo(Role.ACTOR, "gpu", rank=0, world_size=1).device
    model = load_policy(config.models.actor, config.trainer.seed).to(device).train()
    if compiled:
        torch._dynamo.config.cache_size_limit = max(64, shape.layers)
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    temperature = config.generation.temperature

    def log_probs(batch: Sequences) -> Tensor:
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16):
            return policy_outputs(model, batch.to(device), temperature)[0].float().cpu()

    batch = experience(shape, log_probs)

    def update() -> None:
        for rows in torch.split(torch.arange(len(batch)), shape.micro_batch):
            micro = batch.select(rows).to(device)
            with torch.autocast(device.type, torch.bfloat16):
                new, _ = policy_outputs(model, micro, temperature)
            loss = clipped_policy_loss(new.float(), micro.old_log_probs, micro.advantages,
                                       0.2, 0.2, None).loss  # fmt: skip
            normalized = (loss * micro.response_mask).sum().div(micro.response_mask.sum())
            normalized.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(update), sum(p.numel() for p in model.parameters())


def measure(variant: str, shape: Shape) -> Measurement:
    """One variant, in this process (a fresh one per variant)."""
    if variant.startswith("autocast"):
        seconds, parameters = autocast_seconds(shape, compiled=variant == "autocast_compiled")
    else:
        seconds, parameters = actor_seconds(shape, variant.removeprefix("actor_"))
    tokens = shape.sequences * (shape.prompt + shape.response)
    figures = {"tokens_per_s": tokens / seconds, "seconds": seconds, "parameters": parameters}
    peak = peak_flops()
    if peak is not None:
        figures["mfu"] = 6 * parameters * tokens / seconds / peak
        figures["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    else:  # the process's peak RSS: the CPU's "device" memory
        figures["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return figures


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for gpu, flops in PEAK_BF16_FLOPS.items() if gpu in name), None)


def in_own_process(variant: str, shape: Shape) -> Callable[[], Measurement]:
    def run() -> Measurement:
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            return pool.submit(measure, variant, shape).result()

    return run


if __name__ == "__main__":
    gpu = torch.cuda.is_available()
    shape = GPU if gpu else CPU
    device = (
        torch.cuda.get_device_name() if gpu else "no GPU: CPU, tiny config; no GPU figure taken"
    )
    print(f"device: {device}; {shape}", flush=True)
    default = ["actor_bf16", "actor_fp32", "autocast"] + (["autocast_compiled"] if gpu else [])
    names = sys.argv[1:] or default
    variants = {name: in_own_process(name, shape) for name in names}
    run_bench("gpu_train_step", variants, REPEATS, device=device, shape=str(shape))
