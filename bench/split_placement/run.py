"""Benchmark: the same tiny PPO job colocated and split, on one machine, in one run.

colocated: every role on one pool of 1 GPU: the phases of a step run one after another.
split:     actor, rollout and ref on pool "policy", the critic on pool "value" (1 GPU
           each): actor log-probs ∥ values, and update actor ∥ update critic.
Each role has the same resources in both runs (one simulated GPU; on a CPU machine
each worker computes on one thread), so the colocated phase times hold for both and
the ideal is what overlapping them saves:

    ideal split step = colocated step - (Σ colocated phases - split plan's step over them)

where the split plan's step (plan.step_seconds) takes the slowest lane of each stage.
Driver work (packing, advantages, the rule-based reward) is in both steps and never
overlaps, so it is in the ideal too. The model is sized so actor and critic updates cost
about the same (the critic is the actor's backbone with a value head).

Prints per-phase times and a final JSON line. Run: make bench-split (a few minutes).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import Phase, plan_placement
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter

WARMUP_STEPS = 3  # vLLM's first generations and the allocators warm up
MEASURED_STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 15

POLICY_ROLES = {"actor": "policy", "rollout": "policy", "ref": "policy"}


def job(split: bool, checkpoints: Path) -> JobConfig:
    pools = [{"name": "policy", "replicas": 1, "gpusPerNode": 1}]
    if split:
        pools.append({"name": "value", "replicas": 1, "gpusPerNode": 1})
    tiny = {"architecture": "qwen2", "hiddenSize": 256, "numLayers": 4, "numHeads": 4}
    return JobConfig.model_validate(
        {
            "pools": pools,
            "roles": {**POLICY_ROLES, "critic": "value" if split else "policy"},
            "models": {
                "actor": {"tiny": {**tiny, "vocabSize": 64}},
                "reward": {"function": "toy_copy"},
            },
            "data": {"train": "toy:copy", "maxPromptLength": 16, "maxResponseLength": 16},
            "algorithm": {"klCoef": 0.01},
            "generation": {"gpuMemoryUtilization": 0.3},
            "trainer": {
                "totalSteps": WARMUP_STEPS + MEASURED_STEPS,
                "batchSize": 64,
                "miniBatchSize": 16,
                "epochs": 2,
                "actorLearningRate": 1e-4,
                "criticLearningRate": 1e-4,
                "checkpoint": {"path": str(checkpoints), "everySteps": 1_000_000},
            },
        }
    )


def measure(config: JobConfig) -> list[StepResult]:
    steps: list[StepResult] = []
    with local_ray_cluster(config):
        run_job(config, "bench", ConsoleReporter(every=1e9), on_step=steps.append)
    return steps[WARMUP_STEPS:]


def mean_phases(steps: Sequence[StepResult]) -> dict[str, float]:
    phases = {phase for s in steps for phase in s.phase_seconds}
    return {p: sum(s.phase_seconds.get(p, 0.0) for s in steps) / len(steps) for p in phases}


def mean_step(steps: Sequence[StepResult]) -> float:
    return sum(s.seconds for s in steps) / len(steps)


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        colocated_config, split_config = job(False, Path(tmp) / "c"), job(True, Path(tmp) / "s")
        colocated, split = measure(colocated_config), measure(split_config)
    phases = mean_phases(colocated)
    print(f"{'phase':<16}{'colocated s':>12}{'split s':>10}")
    split_phases = mean_phases(split)
    for phase in Phase:
        print(f"{phase:<16}{phases.get(phase, 0):>12.3f}{split_phases.get(phase, 0):>10.3f}")
    colocated_step, split_step = mean_step(colocated), mean_step(split)
    serial = plan_placement(colocated_config).step_seconds(phases)
    overlapped = plan_placement(split_config).step_seconds(phases)
    ideal_split_step = colocated_step - (serial - overlapped)
    measured, ideal = colocated_step / split_step, colocated_step / ideal_split_step
    return {
        "steps": MEASURED_STEPS,
        "colocated_step_s": round(colocated_step, 4),
        "split_step_s": round(split_step, 4),
        "measured_speedup": round(measured, 3),
        "ideal_speedup": round(ideal, 3),
        "efficiency": round(measured / ideal, 3),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
