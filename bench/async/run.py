"""Benchmark: synchronous and fully-async PPO on the same two simulated GPUs, in one run.

Both runs: the rollout on pool "rollout" (1 GPU), actor and critic on pool "train"
(1 GPU; no ref, klCoef 0). Synchronous: generate, then train, then sync, so each pool
waits for the other. Fully async (stalenessThreshold 1, partial rollout, a weight sync
every 2 steps): the rollout pool keeps generating while the train pool trains.

Response lengths are long-tailed: the tiny random policy rarely samples its
end-of-sequence token, so lengths spread from 1 to the 192-token cap (mean ~53) and a
synchronous batch waits for its longest response. The learning rates are tiny so the
distribution does not drift while measuring.

The model (hidden 96, 2 layers) is sized so that generating a batch and training on it
take about the same time (0.74 s and 0.76 s): that is where overlapping them pays
most, and the only place both pools can be busy; with unequal work the faster pool
idles for the difference whatever the scheduling.

The bound: a third run measures each pool alone (`alone.py`): the rollout pool
streaming with nothing training, then the train pool training on those samples with
nothing generating. Pipeline efficiency = async samples/s / the slower pool's rate
alone. (The synchronous run's phase times bound nothing: a synchronous batch waits for
its longest response, a stream does not.)

The three runs are interleaved, 3 times by default (each figure: median and min-max),
and compared within each repeat. Idle shares are each pool's time without a span over
the measured steps; the driver share is the time in no role's span. Run: make
bench-async (about 15 minutes). Arguments, all optional: measured steps, response cap,
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
DESIGN = TRAIN_BOUND  # set from the trials
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
