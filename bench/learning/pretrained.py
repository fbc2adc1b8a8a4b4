"""Benchmark: does LoRA learn from a pretrained base, where full fine-tuning does?

bench.learning.run's `lora` mode starts from the randomly initialised toy model, which is
not what LoRA is meant for. Here the toy is pretrained first: the local example
(synchronous colocated, full fine-tuning, as `sync-colocated`) for PRETRAIN_STEPS steps
with seed PRETRAIN_SEED, its policy written by the job itself (`output`, fp32) as a
Hugging Face directory. Two modes then continue from that directory (`models.actor.path`;
the ref and the critic's backbone start from it too), for the same steps:
    full-pretrained   all weights, as sync-colocated (learning rate 1e-3)
    lora-pretrained   a LoRA adapter as run.py's lora mode (rank 16, alpha 32, all seven
                      linear layers, learning rate 1e-2); the ref is the frozen base.
                      From this base 1e-2 first unlearns (README)
    lora-pretrained-lr1e-3   the same at 1e-3, which learns a little (README)

Every mode runs once per seed (0, 1, 2 by default), the modes interleaved within a seed,
measured and reported as run.py's modes: the held-out reward at the start, at the end
and its best, pass@4 and samples/s, median (min-max) over the seeds; within each seed,
LoRA's final held-out reward less full fine-tuning's. The base's own held-out curve is
printed on stderr first. A PNG of the curves goes to the temporary directory.

Run: python -m bench.learning.pretrained [steps] [seeds] [target], the arguments as
bench.learning.run's (read by it).
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness import Measurement, run_bench
from bench.learning.run import (
    LORA_LEARNING_RATE,
    SEEDS,
    STEPS,
    Build,
    Curve,
    job,
    measure,
    save_curves,
    train,
    with_lora,
)
from rlhf_trainer.api.config import JobConfig
from tests.specs import local_job

# The base: held-out reward about 0.3 (0.12 at random init) after 75 steps (measured,
# 2026-11-28): clearly learned, far from saturated (full fine-tuning reaches ~0.6 by 150).
PRETRAIN_STEPS = 75
PRETRAIN_SEED = 100  # not one of the runs' seeds: no continuation replays its prompts
CHART = Path(tempfile.gettempdir()) / "bench-learning-pretrained.png"


def pretrain(directory: Path) -> Path:
    """Train the toy base and let the job write its policy (output) to `directory`."""
    with tempfile.TemporaryDirectory() as checkpoints:
        spec = job(
            partial(local_job, colocated=True),
            PRETRAIN_SEED,
            Path(checkpoints),
            steps=PRETRAIN_STEPS,
        ).to_dict()
        spec["output"] = {"path": str(directory), "dtype": "fp32"}  # as trained, not bf16
        measure(JobConfig.model_validate(spec), f"base, {PRETRAIN_STEPS} steps")
    return directory


def from_base(base: Path, lora_learning_rate: float | None = None) -> Build:
    """The local example (synchronous colocated) starting from the pretrained base; with
    a learning rate, training a LoRA adapter at it."""

    def build(**schedule: Any) -> JobConfig:
        spec = local_job(colocated=True, **schedule).to_dict()
        spec["models"]["actor"] = {"path": str(base)}
        config = JobConfig.model_validate(spec)
        return config if lora_learning_rate is None else with_lora(config, lora_learning_rate)

    return build


def compare(run: dict[str, Measurement]) -> Measurement:
    """Within one seed, each LoRA mode's final held-out reward less full fine-tuning's."""
    full = run["full-pretrained"]["final_held_out"]
    return {
        f"{mode}.held_out_vs_full": measured["final_held_out"] - full
        for mode, measured in run.items()
        if mode.startswith("lora")
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = pretrain(Path(tmp) / "base")
        modes = {
            "full-pretrained": from_base(base),
            "lora-pretrained": from_base(base, LORA_LEARNING_RATE),
            "lora-pretrained-lr1e-3": from_base(base, 1e-3),
        }
        curves: dict[str, list[Curve]] = {mode: [] for mode in modes}
        variants = {mode: partial(train, modes[mode], curves[mode], mode) for mode in modes}
        run_bench(
            "learning-pretrained",
            variants,
            SEEDS,
            compare,
            steps=STEPS,
            pretrain_steps=PRETRAIN_STEPS,
        )
    save_curves(curves, CHART)


if __name__ == "__main__":
    main()
