"""Each pool of a fully-async job working alone, in one run: the bound that async
training's throughput is measured against (pipeline efficiency = async samples/s over
the slower pool's rate alone).

1. The rollout pool alone: the run starts (its first admission), then `BATCHES` batches
   of prompts more are admitted. The rate is taken from the first batch queued (the
   engine warmed up) until all but the last batch are: the engines stay full meanwhile,
   as in a stream, with no last-response tail. Nothing trains.
2. The train pool alone: the engines are paused, and the trainer trains `STEPS` steps on
   the samples generated in 1, with a weight push into the paused engines every
   triggerParameterSyncStep steps, as the async step does. Nothing generates.

Both go through the product's own classes (`open_run`, `AsyncPPOTrainer`, `PPOTrainer`);
only the schedule, one pool at a time, is the bench's.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness import Measurement
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.cluster.groups import join
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.fully_async import AsyncPPOTrainer
from rlhf_trainer.loop.run import open_run
from rlhf_trainer.loop.sync import Batch
from rlhf_trainer.telemetry.report import ConsoleReporter

BATCHES = 6  # admitted for the generation measurement; STEPS of them are trained after
STEPS = 4


def measure_alone(job: Callable[[Path], JobConfig]) -> Measurement:
    """samples/s of the rollout pool alone and of the train pool alone, and the mean
    response tokens of the samples trained, for the fully-async `job(checkpoint_dir)`."""
    with tempfile.TemporaryDirectory() as tmp:
        config = job(Path(tmp) / "checkpoints")
        assert config.async_ is not None, "a fully-async job"
        with local_ray_cluster(config), open_run(config, "alone", ConsoleReporter(1e9)) as run:
            run.start()
            streaming = run.streaming
            assert streaming is not None
            generated = generate_alone(streaming)
            trained, tokens = train_alone(streaming)
    return {
        "rollout_samples_per_s": generated,
        "train_samples_per_s": trained,
        "response_tokens": tokens,
    }


def generate_alone(streaming: AsyncPPOTrainer) -> float:
    """Samples/s into the queue, from the end of the first batch (the engine warmed up)
    until all but the last batch admitted are queued."""
    batch, n = streaming.config.trainer.batch_size, streaming.group_size
    first = streaming.admission.admitted_total  # prompts run.start() admitted
    streaming.admit_again(
        [
            ((first + i) * n + j, p, streaming.prompts.prompts[p].token_ids)
            for i, p in enumerate(streaming.prompts.next_indices(BATCHES * batch))
            for j in range(n)
        ]
    )
    admitted = (first + BATCHES * batch) * n
    wait_for_depth(streaming, batch * n)
    started, queued = time.time(), queue_depth(streaming)
    finished = wait_for_depth(streaming, admitted - batch * n)
    return (finished - queued) / (time.time() - started)


def train_alone(streaming: AsyncPPOTrainer) -> tuple[float, float]:
    core, batch = streaming.core, streaming.config.trainer.batch_size
    streaming.wait_for_rollout()
    join(core.groups[Role.ROLLOUT].run("pause"))
    started, tokens = time.time(), 0
    for step in range(1, STEPS + 1):
        samples = streaming.take_groups(batch)
        result = core.train_on(
            step, Batch(streaming.prompts_of(samples), [s.rollout for s in samples])
        )
        tokens += result.response_tokens
        core.policy_version += 1
        if step % streaming.sync_every == 0:  # into the paused engines, as a sync would
            core.weight_sync.wait(core.weight_sync.push(core.policy_version))
    return STEPS * batch / (time.time() - started), tokens / (STEPS * batch)


def wait_for_depth(streaming: AsyncPPOTrainer, samples: int) -> int:
    while (depth := queue_depth(streaming)) < samples:
        time.sleep(0.05)
    return depth


def queue_depth(streaming: AsyncPPOTrainer) -> int:
    depth: int = join([streaming.queue.depth.remote()])[0]
    return depth
