"""Benchmark: does the tiny model learn to use a tool, from random initialisation?

examples/agentic-tools.yaml (toy:lookup in rlhf_env.toys:LetterLookup: call the lookup
tool with the key, answer with what it returned; GRPO, 8 episodes a key, synchronous,
one simulated GPU) trained once per seed (trainer.seed 0, 1, 2 by default), against
LetterLookup served in this process (uvicorn in a thread, as the tests serve it). The
held-out keys (toy:lookup:heldout, 8 key-value pairs never trained on) are played
every EVAL_EVERY steps, 8 episodes each at temperature 1 (the example's generation.eval).

Reported per variant, as median (min-max) over the seeds:
    held_out_start    the held-out score before training (step 0)
    held_out_final    the held-out score after the last step
    pass_final        the share of held-out episodes scoring 1 (looked up, answered right)
    tool_calls_first  tool calls per training episode at the first step
    tool_calls_last   the same at the last step
    seconds           the steps' wall-clock, start-up left out
and on stderr a line per run (variant, seed, steps, seconds, the figures above).

Variants other than the example, for comparison (name them to run them, interleaved
with the example within each seed): `ppo-critic` (PPO with a critic, 64 episodes a
step, one per key, critic lr 1e-3), `turns3-tokens4` (3 turns of up to 4 tokens) and
`async` (fully async at staleness 1, the rollout on a pool of its own).

Run: make bench-agentic (about 10 minutes). Arguments, optional: steps (the example's
totalSteps), seeds (3), the other variants to run (comma-separated).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench.harness import Measurement, run_bench
from bench.seeds import Seeds, learned, show_run
from rlhf_env.server import app_for
from rlhf_env.toys import LetterLookup
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter
from tests.environments import served

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"
EVAL_EVERY = 25

Spec = dict[str, Any]


def with_critic(spec: Spec) -> None:
    """PPO with a critic on the same pool: one episode per key, as many per step."""
    spec["roles"]["critic"] = spec["roles"]["actor"]
    spec["algorithm"]["advantageEstimator"] = "gae"
    per_step = spec["trainer"]["batchSize"] * spec["generation"]["samplesPerPrompt"]
    spec["generation"]["samplesPerPrompt"] = 1
    spec["trainer"].update(batchSize=per_step, criticLearningRate=1.0e-3)


def with_longer_turns(spec: Spec) -> None:
    """Room for a second call and for words after the first: 3 turns of up to 4 tokens."""
    spec["data"]["maxResponseLength"] = 4
    spec["generation"]["multiTurn"].update(maxTurns=3, maxTokens=32)


def fully_async(spec: Spec) -> None:
    """Fully async at staleness 1: the rollout on a pool of its own (one more simulated
    GPU), streaming episodes while the actor trains on the batch before."""
    spec["pools"].append({"name": "rollout", "replicas": 1, "gpusPerNode": 1})
    spec["roles"]["rollout"] = "rollout"
    spec["async"] = {"stalenessThreshold": 1}


VARIANTS: dict[str, Callable[[Spec], None]] = {
    "example": lambda spec: None,
    "ppo-critic": with_critic,
    "turns3-tokens4": with_longer_turns,
    "async": fully_async,
}


def job(variant: str, seed: int, steps: int | None, url: str, checkpoints: Path) -> JobConfig:
    """The example as `variant` changes it, for `seed` and `steps` (None: the example's),
    talking to the environment at `url`."""
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec["environments"] = [{"name": "lookup", "url": url}]
    trainer = spec["trainer"]
    trainer.update(seed=seed, evalEverySteps=EVAL_EVERY)
    trainer["totalSteps"] = steps or trainer["totalSteps"]
    trainer["checkpoint"] = {"path": str(checkpoints), "everySteps": 1_000_000}
    VARIANTS[variant](spec)
    return JobConfig.model_validate(spec)


def train(variant: str, seeds: Seeds, steps: int | None, url: str) -> Measurement:
    """The variant's next seed: its held-out scores and tool-call rates."""
    seed = seeds.take(variant)
    seen: list[StepResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = job(variant, seed, steps, url, Path(tmp))
        with local_ray_cluster(config):
            on_step = partial(record, seen)
            run_job(config, "bench", ConsoleReporter(every=1e9), on_step=on_step)
    measured = {**learned(seen, tool_calls=True), "seconds": sum(s.seconds for s in seen)}
    show_run(variant, seed, len(seen), measured)
    return measured


def record(steps: list[StepResult], step: StepResult) -> None:
    """Keep the step; show the run's progress every EVAL_EVERY steps (on stderr)."""
    steps.append(step)
    if step.step % 5 == 0 and step.episodes is not None:
        print(
            f"  step {step.step}: reward {step.reward_mean:.3f}, tool calls "
            f"{step.episodes.tool_calls_mean:.2f}, {step.seconds:.2f} s",
            file=sys.stderr,
            flush=True,
        )


def compare(run: dict[str, Measurement]) -> Measurement:
    """Within one seed, every other variant's final held-out score less the example's."""
    base = run["example"]["held_out_final"]
    return {
        f"{name}.held_out_vs_example": measured["held_out_final"] - base
        for name, measured in run.items()
        if name != "example"
    }


def main(argv: list[str]) -> None:
    """argv: steps (the example's), seeds (3), the other variants (comma-separated)."""
    steps = int(argv[0]) if argv else None
    repeats = int(argv[1]) if len(argv) > 1 else 3
    names = ["example", *(argv[2].split(",") if len(argv) > 2 else [])]
    seeds = Seeds()
    with served({"lookup": app_for(LetterLookup)}) as root:
        url = f"{root}/lookup"
        variants = {name: partial(train, name, seeds, steps, url) for name in names}
        run_bench("agentic", variants, repeats, compare, steps=steps, eval_every=EVAL_EVERY)


if __name__ == "__main__":
    main(sys.argv[1:])
