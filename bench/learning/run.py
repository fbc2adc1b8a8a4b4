"""Benchmark: does each placement learn as well as synchronous PPO, for the same samples?

The local example's task (toy:copy, tiny qwen2, PPO with a critic, klCoef 0.01 fixed)
trained for the same number of samples in eight modes: synchronous colocated (one pool),
split (the critic on a pool of its own), and fully async (the rollout on a pool of its
own) with stalenessThreshold 0, 0.5 and 1, partial rollout on, and 0.5 with it off,
and 0.5 taking π_old's log-probs from the rollout engine (oldLogProbs: rollout); and
lora, synchronous colocated with the actor training a LoRA adapter (models.actor.lora:
rank 16, alpha 32, all seven linear layers, learning rate 1e-2) instead of all weights.
The held-out prompts (toy:copy:heldout, 64 letter strings never trained on) are
answered every EVAL_EVERY steps, 4 sampled answers each (temperature 1): the held-out
reward is their mean reward, and pass@4 the share of prompts copied exactly at least once.

Every mode runs once per seed (trainer.seed 0, 1, 2 by default), the modes interleaved
within a seed. Reported per mode, as median (min-max) over the seeds:
    start_held_out   the held-out reward before the first step
    final_held_out   the held-out reward after the last step
    best_held_out    the highest held-out reward of the run
    samples_per_s    training throughput over the steps after the first
and, within each seed against synchronous colocated: the final held-out reward's
difference, and the wall-clock (the steps' seconds, start-up left out) to reach
TARGET held-out reward. Each run's figures are printed on stderr as it ends. A PNG
draws the held-out reward against samples trained and against wall-clock, each mode's
median over the seeds with its min-max band.

Run: make bench-learning (about 50 minutes). Arguments, optional: steps (150), seeds (3),
target held-out reward (0.3), the modes to run (comma-separated; sync-colocated always).
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from bench.harness import Measurement, run_bench
from bench.learning.chart import save_learning_chart
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter
from tests.specs import local_async_job, local_job

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 150
SEEDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
TARGET = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3
EVAL_EVERY = 25
CHART = Path(__file__).parents[2] / "docs" / "bench-learning.png"
if len(sys.argv) > 4:  # a subset of the modes: its chart is not the docs' one
    CHART = Path(tempfile.gettempdir()) / "bench-learning-subset.png"


class Build(Protocol):
    """A mode's job, for a number of steps and a checkpoint folder (tests.specs.local_job)."""

    def __call__(
        self, *, total_steps: int, checkpoint_dir: Path, every_steps: int
    ) -> JobConfig: ...


MODES: dict[str, Build] = {
    "sync-colocated": partial(local_job, colocated=True),
    "split": partial(local_job, colocated=False),
    "async-s0": partial(local_async_job, staleness=0),
    "async-s0.5": partial(local_async_job, staleness=0.5),
    "async-s1": partial(local_async_job, staleness=1),
    "async-s0.5-no-partial": partial(local_async_job, staleness=0.5, partial_rollout=False),
    "async-s0.5-rollout-logprobs": lambda **kw: with_rollout_log_probs(
        local_async_job(staleness=0.5, **kw)
    ),
    # LoRA RL: synchronous colocated, the actor training a rank-16 adapter (alpha 32) on
    # all seven linear layers of the tiny qwen2 (the ref is the frozen base). Its learning
    # rate is 1e-2, ten times the full fine-tuning's 1e-3: an adapter's update is low-rank
    # and starts at zero (B = 0), so it usually needs a larger step; not tuned further.
    "lora": lambda **kw: with_lora(local_job(colocated=True, **kw)),
}
# Optional 4th argument: the modes to run, comma-separated (synchronous colocated always).
if len(sys.argv) > 4:
    MODES = {m: b for m, b in MODES.items() if m == "sync-colocated" or m in sys.argv[4].split(",")}


def with_rollout_log_probs(config: JobConfig) -> JobConfig:
    """π_old from the rollout engine's log-probs, not recomputed (algorithm.oldLogProbs)."""
    spec = config.to_dict()
    spec["algorithm"]["oldLogProbs"] = "rollout"
    return JobConfig.model_validate(spec)


LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_LEARNING_RATE = 1e-2


def with_lora(config: JobConfig, learning_rate: float = LORA_LEARNING_RATE) -> JobConfig:
    """The actor trains a LoRA adapter (models.actor.lora), at LoRA's learning rate."""
    spec = config.to_dict()
    spec["models"]["actor"]["lora"] = {"rank": 16, "alpha": 32, "targetModules": LORA_MODULES}
    spec["trainer"]["actorLearningRate"] = learning_rate
    return JobConfig.model_validate(spec)


@dataclass(frozen=True)
class Curve:
    """One run's held-out reward after each evaluated step."""

    samples: list[int]  # trained before the evaluation
    seconds: list[float]  # the steps' wall-clock before it (start-up left out)
    reward: list[float]

    def reached(self, target: float) -> float:
        """Seconds until the held-out reward first reached `target`; NaN if never."""
        return next(
            (s for s, r in zip(self.seconds, self.reward, strict=True) if r >= target), math.nan
        )


CURVES: dict[str, list[Curve]] = {mode: [] for mode in MODES}


def job(build: Build, seed: int, checkpoints: Path, steps: int = STEPS) -> JobConfig:
    base = build(total_steps=steps, checkpoint_dir=checkpoints, every_steps=1_000_000)
    spec = base.to_dict()
    spec["trainer"].update(seed=seed, evalEverySteps=EVAL_EVERY)
    spec["data"]["eval"] = "toy:copy:heldout"
    spec["generation"]["eval"] = {"samplesPerPrompt": 4, "temperature": 1.0}
    return JobConfig.model_validate(spec)


def save_curves(curves: dict[str, list[Curve]], chart: Path) -> None:
    """Each mode's curves drawn to `chart` (its path on stderr)."""
    runs = {m: [(c.samples, c.seconds, c.reward) for c in mode] for m, mode in curves.items()}
    save_learning_chart(runs, chart)
    print(f"chart: {chart}", file=sys.stderr)


def train(build: Build, curves: list[Curve], mode: str) -> Measurement:
    """The mode's next seed (`curves` holds its runs so far): its held-out curve (kept
    for the chart) and figures."""
    seed = len(curves)
    with tempfile.TemporaryDirectory() as tmp:
        curve, measured = measure(job(build, seed, Path(tmp)), f"{mode} seed {seed}")
    curves.append(curve)
    return measured


def measure(config: JobConfig, label: str) -> tuple[Curve, Measurement]:
    """Run the job: its held-out curve and figures, printed on stderr as `label`."""
    steps: list[StepResult] = []
    with local_ray_cluster(config):
        run_job(config, "bench", ConsoleReporter(every=1e9), on_step=steps.append)
    elapsed = [0.0]
    for step in steps:
        elapsed.append(elapsed[-1] + step.seconds)
    evaluations = sorted((e for s in steps for e in s.evaluations), key=lambda e: e.step)
    curve = Curve(
        samples=[e.step * config.samples_per_step for e in evaluations],
        seconds=[elapsed[e.step] for e in evaluations],
        reward=[e.reward_mean for e in evaluations],
    )
    timed = steps[1:]  # after the engine's warm-up
    measured = {
        "start_held_out": curve.reward[0],
        "final_held_out": curve.reward[-1],
        "best_held_out": max(curve.reward),
        "final_pass_at_4": evaluations[-1].pass_at_k or 0.0,
        "samples_per_s": config.samples_per_step * len(timed) / sum(s.seconds for s in timed),
    }
    # Each run as it ends (stderr): a bench stopped early still has its finished seeds.
    figures = ", ".join(f"{k} {v:.4g}" for k, v in measured.items())
    reached = curve.reached(TARGET)
    print(
        f"[{label}] {figures}, held-out {curve.reward}, to {TARGET}: {reached:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return curve, measured


def compare(run: dict[str, Measurement]) -> Measurement:
    """Within one seed, every mode against synchronous colocated."""
    base = run["sync-colocated"]
    return {
        f"{mode}.held_out_vs_sync": measured["final_held_out"] - base["final_held_out"]
        for mode, measured in run.items()
        if mode != "sync-colocated"
    }


def to_target_table() -> list[str]:
    """Per mode: in how many seeds the held-out reward reached TARGET, and the median
    wall-clock it took in those."""
    lines = [f"held-out reward >= {TARGET}: seeds reaching it, median seconds (min-max)"]
    for mode, curves in CURVES.items():
        times = [t for t in (c.reached(TARGET) for c in curves) if not math.isnan(t)]
        spread = (
            f"{statistics.median(times):.1f} s ({min(times):.1f}-{max(times):.1f})"
            if times
            else "-"
        )
        lines.append(f"  {mode:<24} {len(times)}/{len(curves)}  {spread}")
    return lines


def main() -> None:
    variants = {mode: partial(train, MODES[mode], CURVES[mode], mode) for mode in MODES}
    run_bench(
        "learning", variants, SEEDS, compare, steps=STEPS, eval_every=EVAL_EVERY, target=TARGET
    )
    # On stderr: the record stays the last line of stdout (`python -m bench` reads it).
    print("\n".join(to_target_table()), file=sys.stderr)
    save_curves(CURVES, CHART)


if __name__ == "__main__":
    main()
