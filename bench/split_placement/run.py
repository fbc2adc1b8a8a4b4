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

The colocated and split runs are interleaved, 3 times by default (each figure: median
and min-max). Beside the speedup and its ideal, it reports each phase's slowdown when it
runs beside the other pool (split phase time over colocated), each pool's idle share and
the driver's own share of a step (time in no role's span): together they say where the
gap to the ideal goes. Run: make bench-split (about 10 minutes). Arguments, both
optional: measured steps per run, repeats.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from bench.estimate import predicted_step
from bench.harness import Measurement, run_bench
from bench.runs import measure_run
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import Phase, plan_placement

WARMUP_STEPS = 3  # vLLM's first generations and the allocators warm up
MEASURED_STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 15
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 3

# Actor and critic (its backbone plus a value head) of about equal cost; the contention
# bench trains the same model.
MODEL = {"architecture": "qwen2", "hiddenSize": 256, "numLayers": 4, "numHeads": 4, "vocabSize": 64}
POLICY_ROLES = {"actor": "policy", "rollout": "policy", "ref": "policy"}


def job(split: bool, checkpoints: Path) -> JobConfig:
    pools = [{"name": "policy", "replicas": 1, "gpusPerNode": 1}]
    if split:
        pools.append({"name": "value", "replicas": 1, "gpusPerNode": 1})
    return JobConfig.model_validate(
        {
            "pools": pools,
            "roles": {**POLICY_ROLES, "critic": "value" if split else "policy"},
            "models": {
                "actor": {"tiny": MODEL},
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


def measure(split: bool) -> Measurement:
    """One run: the mean step and phases of its measured steps, pool idle and driver shares."""
    return measure_run(partial(job, split), WARMUP_STEPS)[1]


def compare(run: dict[str, Measurement]) -> Measurement:
    """Within one repeat: the speedup, its ideal from the colocated phases, each phase's
    slowdown beside the other pool."""
    colocated, split = run["colocated"], run["split"]
    phases = {
        Phase(k.removeprefix("phase.")): v for k, v in colocated.items() if k.startswith("phase.")
    }
    unused = Path("unused")  # the plan needs no checkpoint
    serial = plan_placement(job(False, unused)).step_seconds(phases)
    overlapped = plan_placement(job(True, unused)).step_seconds(phases)
    measured = colocated["step_s"] / split["step_s"]
    ideal = colocated["step_s"] / (colocated["step_s"] - (serial - overlapped))
    predicted = predicted_step(job(False, unused), colocated, job(True, unused))
    slowdown = {
        f"slowdown.{key.removeprefix('phase.')}": split[key] / value
        for key, value in colocated.items()
        if key.startswith("phase.") and key in split and value > 0
    }
    return {
        "measured_speedup": measured,
        "ideal_speedup": ideal,
        "efficiency": measured / ideal,
        "estimate_error": predicted / split["step_s"] - 1,  # rates from the colocated run
        **slowdown,
    }


def main() -> None:
    run_bench(
        "split",
        {"colocated": partial(measure, False), "split": partial(measure, True)},
        REPEATS,
        compare,
        measured_steps=MEASURED_STEPS,
    )


if __name__ == "__main__":
    main()
