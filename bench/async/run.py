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

The two runs are interleaved, 3 times by default (each figure: median and min-max), and
compared within each repeat. Idle shares are each pool's time without a span over the
measured steps; the driver share is the time in no role's span. There is no "ideal"
figure: the synchronous run's phase times bound nothing here (a synchronous batch waits
for its longest response, a stream does not), and measuring each pool alone is still to
come. Run: make bench-async (about 10 minutes). Arguments, all optional: measured steps,
response cap, staleness threshold, sync every K steps, repeats.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness import Measurement, run_bench
from bench.runs import measure_run
from rlhf_trainer.api.config import JobConfig

WARMUP_STEPS = 3
MEASURED_STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 15
BATCH = 32
RESPONSE_CAP = int(sys.argv[2]) if len(sys.argv) > 2 else 192
STALENESS = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
SYNC_EVERY = int(sys.argv[4]) if len(sys.argv) > 4 else 2
REPEATS = int(sys.argv[5]) if len(sys.argv) > 5 else 3


def job(fully_async: bool, checkpoints: Path) -> JobConfig:
    spec: dict[str, Any] = {
        "pools": [
            {"name": "train", "replicas": 1, "gpusPerNode": 1},
            {"name": "rollout", "replicas": 1, "gpusPerNode": 1},
        ],
        # No ref (klCoef 0): the train pool's work stays near the rollout pool's.
        "roles": {"actor": "train", "critic": "train", "rollout": "rollout"},
        "models": {
            "actor": {"tiny": {"hiddenSize": 96, "numLayers": 2, "numHeads": 3, "vocabSize": 64}},
            "reward": {"function": "toy_copy"},
        },
        "data": {"train": "toy:copy", "maxPromptLength": 16, "maxResponseLength": RESPONSE_CAP},
        "algorithm": {"klCoef": 0},
        "generation": {"gpuMemoryUtilization": 0.3},
        "trainer": {
            "totalSteps": WARMUP_STEPS + MEASURED_STEPS,
            "batchSize": BATCH,
            "miniBatchSize": 16,
            "microBatchSize": 8,
            "actorLearningRate": 1e-7,
            "criticLearningRate": 1e-7,
            "checkpoint": {"path": str(checkpoints), "everySteps": 1_000_000},
        },
    }
    if fully_async:
        spec["async"] = {"stalenessThreshold": STALENESS, "triggerParameterSyncStep": SYNC_EVERY}
    return JobConfig.model_validate(spec)


def measure(fully_async: bool) -> Measurement:
    """One run: samples/s and response length over the measured steps, beside the mean
    step and phases, each pool's idle share and the driver's share."""
    measured, figures = measure_run(partial(job, fully_async), WARMUP_STEPS)
    return {
        "samples_per_s": BATCH * len(measured) / sum(s.seconds for s in measured),
        "response_length": sum(s.response_tokens for s in measured) / BATCH / len(measured),
        **figures,
    }


def compare(run: dict[str, Measurement]) -> Measurement:
    return {"ratio": run["async"]["samples_per_s"] / run["sync"]["samples_per_s"]}


def main() -> None:
    run_bench(
        "async",
        {"sync": partial(measure, False), "async": partial(measure, True)},
        REPEATS,
        compare,
        measured_steps=MEASURED_STEPS,
        response_cap=RESPONSE_CAP,
        staleness=STALENESS,
        sync_every=SYNC_EVERY,
    )


if __name__ == "__main__":
    main()
