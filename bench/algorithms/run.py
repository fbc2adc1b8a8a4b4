"""Benchmark: PPO (GAE, with a critic) against GRPO (no critic) on the toy task, for the
same budget of samples, in one run.

Both train the local example's tiny model colocated on one simulated GPU, with the same
learning rate and KL coefficient. PPO: 32 prompts a step, one response each, a critic.
GRPO: 8 prompts a step, 4 responses each (the same 32 samples a step), the group's
mean and std as the baseline, no critic. Reported per algorithm: samples/s over the
steps after the first (engine warm-up), the mean reward of the last 5 steps (after
SAMPLES samples), and the fitted rise of the reward over the run.

Prints a table and a final JSON line. Run: make bench-algorithms (a few minutes).
Argument, optional: the budget of samples (default 1280, 40 steps).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-cpu.yaml"
SAMPLES = int(sys.argv[1]) if len(sys.argv) > 1 else 1280
SAMPLES_PER_STEP = 32
LAST = 5  # steps whose mean reward is reported

ALGORITHMS: dict[str, dict[str, Any]] = {
    "ppo": {"estimator": "gae", "prompts": 32, "n": 1},
    "grpo": {"estimator": "grpo", "prompts": 8, "n": 4},
}


def job(name: str, checkpoints: Path) -> JobConfig:
    algorithm = ALGORITHMS[name]
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec["pools"] = spec["pools"][:1]
    pool = spec["pools"][0]["name"]
    spec["roles"] = {"actor": pool, "rollout": pool, "ref": pool}
    if algorithm["estimator"] == "gae":
        spec["roles"]["critic"] = pool
    spec["algorithm"] = {"klCoef": 0.01, "advantageEstimator": algorithm["estimator"]}
    spec["generation"]["samplesPerPrompt"] = algorithm["n"]
    spec["trainer"].update(
        totalSteps=SAMPLES // SAMPLES_PER_STEP,
        batchSize=algorithm["prompts"],
        miniBatchSize=16,
        checkpoint={"path": str(checkpoints), "everySteps": 1_000_000},
    )
    return JobConfig.model_validate(spec)


def train(config: JobConfig) -> list[StepResult]:
    steps: list[StepResult] = []
    with local_ray_cluster(config):
        run_job(config, "bench", ConsoleReporter(every=1e9), on_step=steps.append)
    return steps


def summary(steps: list[StepResult]) -> dict[str, Any]:
    rewards = [s.reward_mean for s in steps]
    timed = steps[1:]
    slope = float(np.polyfit(np.arange(len(rewards)), rewards, deg=1)[0])
    return {
        "samples_per_s": round(SAMPLES_PER_STEP * len(timed) / sum(s.seconds for s in timed), 2),
        "step_s": round(sum(s.seconds for s in timed) / len(timed), 3),
        "reward_first": round(rewards[0], 3),
        f"reward_last_{LAST}": round(sum(rewards[-LAST:]) / LAST, 3),
        "fitted_rise": round(slope * (len(rewards) - 1), 3),
    }


def main() -> dict[str, Any]:
    results: dict[str, Any] = {"samples": SAMPLES}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ALGORITHMS:
            started = time.time()
            results[name] = summary(train(job(name, Path(tmp) / name)))
            results[name]["wall_s"] = round(time.time() - started, 1)
    print(f"{'':<6}" + "".join(f"{key:>16}" for key in results["ppo"]))
    for name in ALGORITHMS:
        print(f"{name:<6}" + "".join(f"{value:>16}" for value in results[name].values()))
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
