"""Benchmark: synchronous and fully-async PPO on the same two simulated GPUs, in one run.

Both runs: the rollout on pool "rollout" (1 GPU), the actor on pool "train" (1 GPU; no
ref, klCoef 0; GRPO, so no critic: see the sizing below). Synchronous: generate, then
train, then sync, so each pool waits for the other. Fully async (stalenessThreshold 1,
partial rollout, a weight sync every 2 steps): the rollout pool keeps generating while
the train pool trains.

Response lengths are long-tailed: the tiny random policy rarely samples its
end-of-sequence token, so lengths spread from 1 to the 192-token cap (mean ~49) and a
synchronous batch waits for its longest response. The learning rates are tiny so the
distribution does not drift while measuring.

The sizing (`DESIGN`): a step is 8 prompts x 4 samples of the tiny qwen2 (hidden 96, 2
layers), GRPO. Overlap pays most where both pools are busy in the async run. Trials of
one repeat, 8 measured steps, 2026-12-06 (seconds a step of 32 samples):

| size | rollout alone | train alone | sync step (generate) | async step | async/sync |
| --- | --- | --- | --- | --- | --- |
| `TRAIN_BOUND`: 32 x 1, GAE (critic trained) | 0.097 | 0.380 | 0.669 (0.290) | 0.390 | 1.72 |
| `DESIGN`: 8 x 4, GRPO | 0.093 | 0.186 | 0.487 (0.285) | 0.255 | 1.91 |
| 8 x 4, GRPO, hidden 64 | 0.107 | 0.164 | 0.463 (0.308) | 0.261 | 1.78 |
| 8 x 4, GRPO, 1 layer | 0.095 | 0.133 | 0.414 (0.275) | 0.227 | 1.83 |
| 32 x 1, GAE, hidden 64, 1 layer | 0.089 | 0.174 | 0.498 (0.288) | 0.274 | 1.82 |

The critic was half the train pool's work; without it the train pool alone trains a
batch in 0.19 s. Alone, the rollout pool streams one in 0.09 s, but in the async run it
takes about 0.25 s (its idle share 0-17%, the train pool's 17-20%), no faster than the
synchronous batch's generation (0.28 s). Alone it has the machine's 2 cores; in the
async run it shares them with training, and the machine is full: 1.7-1.9 cores busy over
the measured steps, against 1.1 in the synchronous run. Admission is not what holds it:
at stalenessThreshold 3 (three times the prompts admitted a window) the async run made
104 and 103 samples/s, at 1 106 and 111 (interleaved, one run each). A smaller train
pool's work (the rows below `DESIGN`) only leaves that pool idle. So here async/sync is
at most about (generate + train + sync) / generate ~ 1.9, not the 2.3-2.8 that verl and
AReaL report with a GPU for each pool. `make bench-async` at `DESIGN` (2026-12-06 21:52,
3 interleaved repeats): async/sync 1.84 (1.57-1.86); pipeline efficiency 0.62
(0.60-0.82), the bound being the train pool alone (146 samples/s; the rollout pool alone
290), which the async run does not reach for want of generation; idle shares of an
async step: train 24.5%, rollout 7.6%.

The bound: a third run measures each pool alone (`alone.py`): the rollout pool
streaming with nothing training, then the train pool training on those samples with
nothing generating. Pipeline efficiency = async samples/s / the slower pool's rate
alone. (The synchronous run's phase times bound nothing: a synchronous batch waits for
its longest response, a stream does not.)

The three runs are interleaved, 3 times by default (each figure: median and min-max),
and compared within each repeat. Idle shares are each pool's time without a span over
the measured steps; the driver share is the time in no role's span. Run: make
bench-async (about 6 minutes). Arguments, all optional: measured steps, response cap,
staleness threshold, sync every K steps, repeats.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.estimate import predicted_step
from bench.harness import Measurement, run_bench
from bench.runs import measure_run
from rlhf_trainer.api.algorithm import AdvantageEstimator
from rlhf_trainer.api.config import JobConfig

from .alone import measure_alone  # (`bench.async` is no importable name)

WARMUP_STEPS = 3


@dataclass(frozen=True)
class Workload:
    """What a step does: the model, the responses, the samples, what trains."""

    hidden: int
    layers: int
    heads: int
    response_cap: int  # long-tailed lengths: the tiny random policy rarely ends a response
    prompts: int  # a step's prompts (trainer.batchSize)
    samples_per_prompt: int
    estimator: AdvantageEstimator  # "gae" trains a critic beside the actor
    epochs: int = 1

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt


# The sizing of 2026-11-24 (generate 0.74 s, train 0.76 s then; by 2026-12-06 the
# rollout pool streamed 3.8x faster than the train pool trained). bench-elastic and
# bench-slow-reward measured their figures at it, so they keep it.
TRAIN_BOUND = Workload(96, 2, 3, 192, 32, 1, "gae")
DESIGN = Workload(96, 2, 3, 192, 8, 4, "grpo")
# The command line's, when run (`python -m bench.async.run`); the defaults when another
# bench imports the job from here.
ARGS = sys.argv if __name__ == "__main__" else sys.argv[:1]
MEASURED_STEPS = int(ARGS[1]) if len(ARGS) > 1 else 15
RESPONSE_CAP = int(ARGS[2]) if len(ARGS) > 2 else DESIGN.response_cap
STALENESS = float(ARGS[3]) if len(ARGS) > 3 else 1.0
SYNC_EVERY = int(ARGS[4]) if len(ARGS) > 4 else 2
REPEATS = int(ARGS[5]) if len(ARGS) > 5 else 3
WORKLOAD = replace(DESIGN, response_cap=RESPONSE_CAP)


def job(fully_async: bool, checkpoints: Path, size: Workload = WORKLOAD) -> JobConfig:
    critic = size.estimator == "gae"
    spec: dict[str, Any] = {
        "pools": [
            {"name": "train", "replicas": 1, "gpusPerNode": 1},
            {"name": "rollout", "replicas": 1, "gpusPerNode": 1},
        ],
        # No ref (klCoef 0): the train pool's work is the actor's (and the critic's).
        "roles": {"actor": "train", "rollout": "rollout"} | ({"critic": "train"} if critic else {}),
        "models": {
            "actor": {
                "tiny": {
                    "hiddenSize": size.hidden,
                    "numLayers": size.layers,
                    "numHeads": size.heads,
                    "vocabSize": 64,
                }
            },
            "reward": {"function": "toy_copy"},
        },
        "data": {
            "train": "toy:copy",
            "maxPromptLength": 16,
            "maxResponseLength": size.response_cap,
        },
        "algorithm": {"klCoef": 0, "advantageEstimator": size.estimator},
        "generation": {"gpuMemoryUtilization": 0.3, "samplesPerPrompt": size.samples_per_prompt},
        "trainer": {
            "totalSteps": WARMUP_STEPS + MEASURED_STEPS,
            "batchSize": size.prompts,
            "miniBatchSize": 16,
            "microBatchSize": 8,
            "epochs": size.epochs,
            "actorLearningRate": 1e-7,
            "criticLearningRate": 1e-7,
            "checkpoint": {"path": str(checkpoints), "everySteps": 1_000_000},
        },
    }
    if fully_async:
        spec["async"] = {"stalenessThreshold": STALENESS, "triggerParameterSyncStep": SYNC_EVERY}
    return JobConfig.model_validate(spec)


def measure(fully_async: bool, size: Workload = WORKLOAD) -> Measurement:
    """One run: samples/s over the measured steps, beside the mean step and phases, the
    mean response length, each pool's idle share and the driver's share."""
    measured, figures = measure_run(partial(job, fully_async, size=size), WARMUP_STEPS)
    return {
        "samples_per_s": size.samples * len(measured) / sum(s.seconds for s in measured),
        **figures,
    }


def compare(run: dict[str, Measurement]) -> Measurement:
    """The async/sync ratio; the pipeline efficiency, async samples/s over the slower
    pool's alone; and the estimator's error on the async step, from the rollout pool's
    rate alone and the other rates calibrated on the synchronous run (whose phases run
    one after another)."""
    unused = Path("unused")
    alone = run["alone"]
    bound = min(alone["rollout_samples_per_s"], alone["train_samples_per_s"])
    streamed = alone["rollout_tokens_per_s"]  # one rollout GPU
    predicted = predicted_step(job(False, unused), run["sync"], job(True, unused), streamed)
    return {
        "ratio": run["async"]["samples_per_s"] / run["sync"]["samples_per_s"],
        "pipeline_efficiency": run["async"]["samples_per_s"] / bound,
        "estimate_error": predicted / run["async"]["step_s"] - 1,
    }


def main() -> None:
    run_bench(
        "async",
        {
            "sync": partial(measure, False),
            "async": partial(measure, True),
            "alone": partial(measure_alone, partial(job, True)),
        },
        REPEATS,
        compare,
        measured_steps=MEASURED_STEPS,
        **asdict(WORKLOAD),
        staleness=STALENESS,
        sync_every=SYNC_EVERY,
    )


if __name__ == "__main__":
    main()
