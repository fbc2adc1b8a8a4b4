"""Benchmark: a fully-async job whose rollout pool grows from 1 engine to 2 in mid-run,
against two runs of fixed size (1 and 2 engines), interleaved.

The job is bench/async's (`run.job`) at its old size (`run.TRAIN_BOUND`, the size this
bench's figures were measured at). The growing run starts with one rollout node and gets
a second after step GROW_AFTER, as a bigger `replicas` gives it: an engine starts there
in the background and joins at the first weight sync after it is up. Figures:

- samples/s of the growing run before the node came, and once the new engine served,
  beside the fixed runs' samples/s over the same steps;
- the change's cost: the seconds from the node's arrival to the engine serving (the
  trainer trains on meanwhile), and the seconds the join itself held the trainer (the
  weight transfer set up again; the span `engines_joined`).

On these 2 shared cores a second engine has no core of its own: what it adds is
bounded by the CPU, not by the pool. Run: make bench-elastic (about 15 minutes). No
arguments: `run.py` reads its own from the command line when imported.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.harness import Measurement, run_bench
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.membership import ENGINES_JOINED
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter

from .run import TRAIN_BOUND, job  # (`bench.async` is no importable name)

STEPS = 40
REPEATS = 3
WARMUP_STEPS = 3
GROW_AFTER = 8  # the growing run's second rollout node comes after this step


def elastic_job(engines: int, checkpoints: Path) -> JobConfig:
    spec = job(True, checkpoints, TRAIN_BOUND).to_dict()
    spec["trainer"]["totalSteps"] = STEPS
    (rollout,) = [p for p in spec["pools"] if p["name"] == "rollout"]
    rollout["replicas"] = engines
    return JobConfig.model_validate(spec)


def train(engines: int, grow: bool) -> tuple[list[StepResult], float]:
    """The run's steps, and when (time.time) the growing run's node came (0: none)."""
    steps: list[StepResult] = []
    added = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        config = elastic_job(engines, Path(tmp) / "checkpoints")
        with local_ray_cluster(config) as cluster:

            def on_step(step: StepResult) -> None:
                nonlocal added
                steps.append(step)
                if grow and step.step == GROW_AFTER:
                    cluster.add_node("rollout")
                    added = time.time()

            run_job(config, "elastic", ConsoleReporter(every=1e9), None, None, on_step)
    return steps, added


def rate(steps: list[StepResult]) -> float:
    if not steps:
        return float("nan")
    return TRAIN_BOUND.samples * len(steps) / sum(s.seconds for s in steps)


def fixed(engines: int) -> Measurement:
    """samples/s over the steps the growing run measures before and after."""
    steps, _ = train(engines, grow=False)
    return {
        "before_samples_per_s": rate(steps[WARMUP_STEPS:GROW_AFTER]),
        "after_samples_per_s": rate(steps[len(steps) // 2 :]),
    }


def growing() -> Measurement:
    steps, added = train(1, grow=True)
    joined = next(i for i, s in enumerate(steps) if s.rollout_engines == 2)
    # The step that took the engine in ends after it; its start is its end less its time.
    ended = added + sum(s.seconds for s in steps[GROW_AFTER : joined + 1])
    return {
        "before_samples_per_s": rate(steps[WARMUP_STEPS:GROW_AFTER]),
        "after_samples_per_s": rate(steps[max(joined + 1, len(steps) // 2) :]),
        "node_to_serving_s": ended - added,
        "join_stall_s": steps[joined].phase_seconds.get(ENGINES_JOINED, 0.0),
        "joined_at_step": steps[joined].step,
    }


def compare(run: dict[str, Measurement]) -> Measurement:
    grow, one, two = run["grow"], run["fixed_1"], run["fixed_2"]
    return {
        "grow_after_over_before": grow["after_samples_per_s"] / grow["before_samples_per_s"],
        "grow_after_over_fixed_2": grow["after_samples_per_s"] / two["after_samples_per_s"],
        "fixed_2_over_fixed_1": two["after_samples_per_s"] / one["after_samples_per_s"],
    }


def main() -> None:
    run_bench(
        "elastic",
        {"fixed_1": lambda: fixed(1), "grow": growing, "fixed_2": lambda: fixed(2)},
        REPEATS,
        compare,
        steps=STEPS,
        grow_after=GROW_AFTER,
    )


if __name__ == "__main__":
    main()
