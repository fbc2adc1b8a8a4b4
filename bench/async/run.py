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

ideal_ratio is the bound from the synchronous run's own rates: a synchronous step takes
T_gen + T_train; overlapped perfectly, a step takes max(T_gen, T_train). Idle ratios
are each pool's time without a span on the async run's timeline, over the measured
steps. Prints a final JSON line. Run: make bench-async (a few minutes). Arguments, all
optional: measured steps, response cap, staleness threshold, sync every K steps.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.metrics import union_seconds
from rlhf_trainer.telemetry.report import ConsoleReporter

WARMUP_STEPS = 3
MEASURED_STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 15
BATCH = 32
RESPONSE_CAP = int(sys.argv[2]) if len(sys.argv) > 2 else 192
STALENESS = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
SYNC_EVERY = int(sys.argv[4]) if len(sys.argv) > 4 else 2


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


def measure(config: JobConfig, trace: Path) -> tuple[list[StepResult], dict[str, Any]]:
    steps: list[StepResult] = []
    with local_ray_cluster(config):
        run_job(config, "bench", ConsoleReporter(every=1e9), trace=trace, on_step=steps.append)
    return steps[WARMUP_STEPS:], json.loads(trace.read_text())


def window(steps: list[StepResult], trace: dict[str, Any]) -> tuple[float, float]:
    """The measured steps' wall-clock window on the trace's time axis (seconds)."""
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    end = max(e["ts"] + e["dur"] for e in events) / 1e6
    return end - sum(s.seconds for s in steps), end


def idle(trace: dict[str, Any], pool: str, start: float, end: float) -> float:
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    spans = [
        (max(start, e["ts"] / 1e6), min(end, (e["ts"] + e["dur"]) / 1e6))
        for e in trace["traceEvents"]
        if e["ph"] == "X" and names[e["pid"]] == pool
    ]
    return 1 - union_seconds([(a, b) for a, b in spans if b > a]) / (end - start)


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sync, _ = measure(job(False, Path(tmp) / "s"), Path(tmp) / "sync.json")
        streamed, trace = measure(job(True, Path(tmp) / "a"), Path(tmp) / "async.json")
    sync_step = sum(s.seconds for s in sync) / len(sync)
    generate = sum(s.phase_seconds.get(Phase.GENERATE, 0.0) for s in sync) / len(sync)
    train = sync_step - generate
    async_seconds = sum(s.seconds for s in streamed)
    start, end = window(streamed, trace)
    lengths = [s.response_tokens / BATCH for s in sync]
    print(f"sync: step {sync_step:.3f} s = generate {generate:.3f} s + the rest {train:.3f} s")
    print(f"mean response length {sum(lengths) / len(lengths):.1f} tokens (cap {RESPONSE_CAP})")
    print(f"{'phase':<16}{'sync s':>8}{'async s':>9}  (busy seconds per step)")
    for phase in Phase:
        means = [
            sum(s.phase_seconds.get(phase, 0.0) for s in run) / len(run) for run in (sync, streamed)
        ]
        print(f"{phase:<16}{means[0]:>8.3f}{means[1]:>9.3f}")
    print(f"async step {async_seconds / len(streamed):.3f} s")
    sync_rate = BATCH / sync_step
    async_rate = BATCH * len(streamed) / async_seconds
    return {
        "steps": MEASURED_STEPS,
        "sync_samples_per_s": round(sync_rate, 2),
        "async_samples_per_s": round(async_rate, 2),
        "ratio": round(async_rate / sync_rate, 3),
        "ideal_ratio": round(sync_step / max(generate, train), 3),
        "rollouter_idle": round(idle(trace, "rollout", start, end), 3),
        "trainer_idle": round(idle(trace, "train", start, end), 3),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
