"""Each pool of a fully-async job working alone, in one run: the bound that async
training's throughput is measured against (pipeline efficiency = async samples/s over
the slower pool's rate alone).

1. The rollout pool alone: the run starts (its first admission), then `BATCHES` batches
   of prompts more are admitted. The engines' own count of generated tokens (vLLM's)
   gives tokens/s from the first batch queued (the engines warmed up) until all but the
   last batch are: they stay full meanwhile, as in a stream, with no last-response
   tail. Nothing trains. Samples/s = tokens/s over the mean response of every sample
   admitted (the first to finish are the short ones: counting samples would flatter).
2. The train pool alone: every admitted sample is queued, the engines are paused, and
   the trainer trains `STEPS` steps on those samples, shuffled (again, not the short
   ones first), with a weight push into the paused engines every
   triggerParameterSyncStep steps, as the async step does. Nothing generates.

Both go through the product's own classes (`open_run`, `AsyncPPOTrainer`, `PPOTrainer`);
only the schedule, one pool at a time, is the bench's.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness import Measurement
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.loop.fully_async import AsyncPPOTrainer
from rlhf_trainer.loop.run import open_run
from rlhf_trainer.loop.sync import Batch
from rlhf_trainer.rollout.samples import Sample
from rlhf_trainer.telemetry.report import ConsoleReporter

BATCHES = 6  # admitted after the run's first admission, to keep the engines full
# Trained on samples drawn from everything admitted; 8, not 4: at 4 (0.8-1.6 s) the bound
# moved 69.6-79.3 samples/s across 3 repeats (2026-12-06).
STEPS = 8


def measure_alone(job: Callable[[Path], JobConfig]) -> Measurement:
    """samples/s of the rollout pool alone and of the train pool alone, and the mean
    response tokens of the samples, for the fully-async `job(checkpoint_dir)`."""
    with tempfile.TemporaryDirectory() as tmp:
        config = job(Path(tmp) / "checkpoints")
        assert config.async_ is not None, "a fully-async job"
        quiet = ConsoleReporter(every=1e9)
        with local_ray_cluster(config), open_run(config, "alone", quiet) as run:
            run.start()
            streaming = run.streaming
            assert streaming is not None
            tokens_per_s, admitted = generate_alone(streaming)
            samples = all_queued(streaming, admitted)
            trained_per_s = train_alone(streaming, samples)
    response = sum(len(s.rollout.response_token_ids) for s in samples) / len(samples)
    return {
        "rollout_tokens_per_s": tokens_per_s,
        "rollout_samples_per_s": tokens_per_s / response,
        "train_samples_per_s": trained_per_s,
        "response_tokens": response,
    }


def generate_alone(streaming: AsyncPPOTrainer) -> tuple[float, int]:
    """Tokens/s the engines generate while full, and the samples admitted in all."""
    batch, n = streaming.config.trainer.batch_size, streaming.group_size
    first = streaming.admission.admitted_total  # prompts run.start() admitted
    streaming.admissions.give(
        [
            ((first + i) * n + j, p, streaming.prompts.prompts[p].token_ids)
            for i, p in enumerate(streaming.prompts.next_indices(BATCHES * batch))
            for j in range(n)
        ]
    )
    admitted = (first + BATCHES * batch) * n
    wait_for_depth(streaming, batch * n)
    started, generated = time.time(), generated_tokens(streaming)
    wait_for_depth(streaming, admitted - batch * n)
    return (generated_tokens(streaming) - generated) / (time.time() - started), admitted


def all_queued(streaming: AsyncPPOTrainer, admitted: int) -> list[Sample]:
    """Every admitted sample, once all are queued, shuffled by group (seeded)."""
    n = streaming.group_size
    wait_for_depth(streaming, admitted)
    samples = streaming.take_groups(admitted // n)
    groups = [samples[i : i + n] for i in range(0, len(samples), n)]
    random.Random(0).shuffle(groups)
    return [sample for group in groups for sample in group]


def train_alone(streaming: AsyncPPOTrainer, samples: list[Sample]) -> float:
    """Samples/s of STEPS steps trained on `samples` with the engines paused."""
    core, size = streaming.core, streaming.config.samples_per_step
    assert len(samples) >= STEPS * size, f"{len(samples)} samples for {STEPS} steps of {size}"
    join(core.groups[Role.ROLLOUT].run("pause"))
    started = time.time()
    for step in range(1, STEPS + 1):
        taken = samples[(step - 1) * size : step * size]
        rollouts, uids = [s.rollout for s in taken], [s.uid for s in taken]
        core.train_on(step, Batch(streaming.prompts_of(taken), rollouts, uids))
        core.policy_version += 1
        if step % streaming.sync_every == 0:  # into the paused engines, as a sync would
            core.weight_sync.push(core.policy_version)
    return STEPS * size / (time.time() - started)


def generated_tokens(streaming: AsyncPPOTrainer) -> int:
    """The rollout engines' count of tokens generated so far (vLLM's own)."""
    rollout = streaming.core.groups[Role.ROLLOUT]
    stats = join([rollout.engine_stats(rank) for rank in range(rollout.world_size)])
    assert None not in stats, "an engine without vLLM stats"
    return sum(s.generation_tokens for s in stats if s is not None)


def wait_for_depth(streaming: AsyncPPOTrainer, samples: int) -> None:
    while queue_depth(streaming) < samples:
        time.sleep(0.05)


def queue_depth(streaming: AsyncPPOTrainer) -> int:
    depth: int = join([streaming.queue.depth.remote()])[0]
    return depth
