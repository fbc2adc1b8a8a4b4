"""Benchmark: PPO (GAE, with a critic) against GRPO (no critic) on the toy task, for the
same budget of samples, in one run.

Both train the local example's tiny model colocated on one simulated GPU, with the same
learning rate and KL coefficient. PPO: 32 prompts a step, one response each, a critic.
GRPO: 8 prompts a step, 4 responses each (the same 32 samples a step), the group's
mean and std as the baseline, no critic. Reported per algorithm: samples/s over the
steps after the first (engine warm-up), the mean reward of the last 5 steps (after
SAMPLES samples), and the fitted rise of the reward over the run.

The two are interleaved, 3 times by default; each figure is the median and min-max, and
the speedup (GRPO's samples/s over PPO's) is taken within each repeat. Run: make
bench-algorithms (about 10 minutes). Arguments, optional: the budget of samples (default
1280, 40 steps), repeats.
"""

from __future__ import annotations

import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.harness import Measurement, run_bench
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-cpu.yaml"
SAMPLES = int(sys.argv[1]) if len(sys.argv) > 1 else 1280
SAMPLES_PER_STEP = 32
LAST = 5  # steps whose mean reward is reported
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 3

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


def train(name: str) -> Measurement:
    """One run of the algorithm: its speed and how its reward rose."""
    steps: list[StepResult] = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        config = job(name, Path(tmp))
        with local_ray_cluster(config):
            run_job(config, "bench", ConsoleReporter(every=1e9), on_step=steps.append)
    rewards = [s.reward_mean for s in steps]
    timed = steps[1:]  # after the engine's warm-up
    slope = float(np.polyfit(np.arange(len(rewards)), rewards, deg=1)[0])
    return {
        "samples_per_s": SAMPLES_PER_STEP * len(timed) / sum(s.seconds for s in timed),
        "step_s": sum(s.seconds for s in timed) / len(timed),
        "reward_first": rewards[0],
        f"reward_last_{LAST}": sum(rewards[-LAST:]) / LAST,
        "fitted_rise": slope * (len(rewards) - 1),
        "wall_s": time.time() - started,
    }


def compare(run: dict[str, Measurement]) -> Measurement:
    return {"grpo_speedup": run["grpo"]["samples_per_s"] / run["ppo"]["samples_per_s"]}


def main() -> None:
    variants = {name: partial(train, name) for name in ALGORITHMS}
    run_bench("algorithms", variants, REPEATS, compare, samples=SAMPLES)


if __name__ == "__main__":
    main()
