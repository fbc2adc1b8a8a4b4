"""Benchmark: the toy tool task driven by a plain `openai` agent through the gateway,
against the trainer-driven multi-turn job on the same task.

Both variants train examples/agentic-tools.yaml (toy:lookup: call the lookup tool with
the key, answer with what it returned; GRPO, 8 episodes a key, synchronous, one
simulated GPU) for the same steps and seed, interleaved within each seed:

    trainer   the example as it is: the trainer samples each turn, parses the call
              (rlhf_toy) and steps rlhf_env.toys:LetterLookup, served in a process of
              its own (`python -m rlhf_env serve`), which scores the episode
    agent     generation.agent: examples/agents/letters_agent.py (bench/agent_gateway/
              timed_agent.py: the same `run`, timed), served in a process of its own
              (`python -m rlhf_env agent`), runs its own loop against each engine's
              gateway (vLLM's chat serving, the rlhf_toy parser) and grades the answer
              as LetterLookup scores it; up to 2 calls of up to 2 tokens, as the
              example's 2 turns of up to 2 tokens, all 64 episodes of a step at once

Reported per variant, median (min-max) over the seeds:
    reward_first, reward_last   the training reward: the first step's, the last 5 steps'
    held_out_start, held_out_final   the held-out keys' score (8 episodes each, at
                                temperature 1) before training and after the last step
    pass_final                  the share of held-out episodes scoring 1, after it
    tool_calls_first, tool_calls_last   tool calls per training episode (trainer only:
                                an agent's calls are its own)
    episodes_per_s, tokens_per_s   the rollout's throughput: a step's episodes and its
                                trained sampled tokens over its generate phase, over the
                                steps after the first (start-up and compilation)
    step_s                      the mean step, the same steps
and, for the agent, from its own timings of those steps' episodes: call_s (a call's
mean round trip through the gateway), calls_per_episode, own_share (the share of an
episode spent outside its calls: the agent's own loop), episode_s (an episode's mean
seconds, from the agent's `run` called to its return) beside generate_s (the mean
generate phase), in_flight (the episodes' seconds over the generate phases': how many
ran at once, on average; 64 are sent at once) and sampled_tokens_per_s (every sampled
token, those of samples left out too). Within each seed: agent over trainer of the
throughput and the step, and the agent's final held-out score less the trainer's.

Run: make bench-agent-gateway (about 15 minutes). Arguments, optional: steps (50), seeds (3).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench.agent_gateway.timed_agent import TIMINGS_VARIABLE
from bench.harness import Measurement, run_bench
from bench.seeds import Seeds, learned, show_run
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import local_environments, local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.report import ConsoleReporter

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"
WARMUP_STEPS = 1
LAST_STEPS = 5  # the final training reward: a mean over these, one step is noisy
EPISODES_A_STEP = 64  # the example's batchSize 8 x samplesPerPrompt 8
AGENT = "bench.agent_gateway.timed_agent:run"

Spec = dict[str, Any]


def trainer_driven(spec: Spec) -> None:
    """The example as it is (its environment served by class, in a process of its own)."""


def agent_driven(spec: Spec) -> None:
    """The letters agent in place of the trainer's loop: its calls as the example's turns
    (2 of up to 2 tokens), the engine's context room for the second call's prompt."""
    del spec["environments"], spec["generation"]["multiTurn"]
    spec["agents"] = [{"name": "letters", "serve": AGENT, "maxConcurrentEpisodes": 64}]
    spec["generation"]["agent"] = {
        "agent": "letters",
        "toolParser": "rlhf_toy",
        "maxCalls": 2,
        "maxCallTokens": spec["data"]["maxResponseLength"],
    }
    spec["data"]["maxResponseLength"] = 16  # the example's multiTurn.maxTokens


VARIANTS = {"trainer": trainer_driven, "agent": agent_driven}


def job(variant: str, seed: int, steps: int, checkpoints: Path) -> JobConfig:
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    trainer = spec["trainer"]
    trainer.update(seed=seed, totalSteps=steps, evalEverySteps=steps)
    trainer["checkpoint"] = {"path": str(checkpoints), "everySteps": 1_000_000}
    VARIANTS[variant](spec)
    return JobConfig.model_validate(spec)


def train(variant: str, seeds: Seeds, steps: int) -> Measurement:
    """The variant's next seed, trained: its figures (the module doc)."""
    return train_seed(variant, seeds.take(variant), steps)


def train_seed(variant: str, seed: int, steps: int) -> Measurement:
    """One run of `variant` on `seed`, `steps` steps: its figures (the module doc)."""
    seen: list[Seen] = []
    with tempfile.TemporaryDirectory() as tmp, agent_timings(Path(tmp)) as timings:
        config = job(variant, seed, steps, Path(tmp) / "checkpoints")
        metrics = TrainerMetrics(pools=[p.name for p in config.pools])
        on_step = partial(record, seen, metrics)
        with local_environments(config) as served, local_ray_cluster(served):
            run_job(served, "bench", ConsoleReporter(every=1e9), metrics, None, on_step)
        episodes = read_timings(timings)
    results = [s.result for s in seen]
    measured = {**rewards(results), **learned(results, tool_calls=variant == "trainer")}
    measured |= throughput(results[WARMUP_STEPS:])
    if variant == "agent":
        measured |= agent_figures(seen[WARMUP_STEPS:], seen[WARMUP_STEPS - 1], episodes)
    show_run(variant, seed, len(results), measured)
    return measured


@contextmanager
def agent_timings(tmp: Path) -> Iterator[Path]:
    """The file the timed agent appends its episodes to, named in its environment."""
    path = tmp / "agent-timings.jsonl"
    path.touch()
    before = os.environ.get(TIMINGS_VARIABLE)
    os.environ[TIMINGS_VARIABLE] = str(path)
    try:
        yield path
    finally:
        if before is None:
            del os.environ[TIMINGS_VARIABLE]
        else:
            os.environ[TIMINGS_VARIABLE] = before


def read_timings(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@dataclass(frozen=True)
class Seen:
    """A step as the bench saw it end: when, and the agents' sampled tokens so far."""

    result: StepResult
    ended: float  # time.time()
    agent_sampled: float  # rlhf_agent_tokens_total{kind="sampled"}


def record(seen: list[Seen], metrics: TrainerMetrics, step: StepResult) -> None:
    """Keep the step, when it ended and the agents' sampled tokens; a line every 5 steps."""
    found = metrics.registry.get_sample_value("rlhf_agent_tokens_total", {"kind": "sampled"})
    seen.append(Seen(step, time.time(), found or 0.0))
    if step.step % 5 == 0:
        print(
            f"  step {step.step}: reward {step.reward_mean:.3f}, generate "
            f"{step.phase_seconds.get('generate', 0.0):.2f} s of {step.seconds:.2f} s",
            file=sys.stderr,
            flush=True,
        )


def rewards(steps: list[StepResult]) -> Measurement:
    """The training reward at the first step and over the last LAST_STEPS."""
    last = steps[-LAST_STEPS:]
    return {
        "reward_first": steps[0].reward_mean,
        "reward_last": sum(s.reward_mean for s in last) / len(last),
    }


def throughput(measured: list[StepResult]) -> Measurement:
    generate = sum(s.phase_seconds["generate"] for s in measured)
    return {
        "episodes_per_s": EPISODES_A_STEP * len(measured) / generate,
        "tokens_per_s": sum(s.response_tokens for s in measured) / generate,
        "step_s": sum(s.seconds for s in measured) / len(measured),
    }


def agent_figures(
    measured: list[Seen], before: Seen, episodes: list[dict[str, Any]]
) -> Measurement:
    """Where the measured steps' generate phases go, from the agent's own timings of the
    episodes that started between the end of the warm-up and the last step's end (the
    held-out evaluations' run before and after: left out). A step's episodes can start
    before the step is timed (the next batch starts as the last one's update ends), so
    they are not told apart by step: the figures are over them all."""
    generate = sum(s.result.phase_seconds["generate"] for s in measured)
    ran = [e for e in episodes if before.ended < e["start"] <= measured[-1].ended]
    calls = [c for e in ran for c in e["calls"]]
    seconds = [e["end"] - e["start"] for e in ran]
    return {
        "call_s": statistics.mean(calls),
        "calls_per_episode": len(calls) / len(ran),
        "own_share": 1 - sum(calls) / sum(seconds),
        "episode_s": statistics.mean(seconds),
        "generate_s": generate / len(measured),
        "in_flight": sum(seconds) / generate,
        "sampled_tokens_per_s": (measured[-1].agent_sampled - before.agent_sampled) / generate,
    }


def compare(run: dict[str, Measurement]) -> Measurement:
    """Within one seed: the agent's throughput over the trainer's, and its final
    held-out score less the trainer's."""
    agent, trainer = run["agent"], run["trainer"]
    return {
        "episodes_per_s_ratio": agent["episodes_per_s"] / trainer["episodes_per_s"],
        "tokens_per_s_ratio": agent["tokens_per_s"] / trainer["tokens_per_s"],
        "step_s_ratio": agent["step_s"] / trainer["step_s"],
        "held_out_vs_trainer": agent["held_out_final"] - trainer["held_out_final"],
    }


def main(argv: list[str]) -> None:
    """argv: steps (50), seeds (3)."""
    steps = int(argv[0]) if argv else 50
    repeats = int(argv[1]) if len(argv) > 1 else 3
    seeds = Seeds()
    variants = {name: partial(train, name, seeds, steps) for name in VARIANTS}
    run_bench("agent_gateway", variants, repeats, compare, steps=steps)


if __name__ == "__main__":
    main(sys.argv[1:])
