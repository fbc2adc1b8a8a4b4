"""The real instruct model learning sums with GRPO, judged on sums it never trains on.

SmolLM2-135M-Instruct (tests/real_model.py), every role on one simulated GPU, fp32:
GRPO (4 answers to each of 8 questions a step, no critic), klCoef 0.01, the correctness
reward (`math_answer`: the answer's last number is the sum). The training questions
and the held-out ones are disjoint (tests.real_model.sums_dataset numbers each pair of
addends). The held-out questions are answered greedily before training, every
EVAL_EVERY steps and at the end: the report is their accuracy (pass@1) then, with
the steps and the seconds it took.

With a LoRA rank as the third argument, the actor trains a LoRA adapter of that rank
on all seven linear layers of each decoder layer (alpha = 2 x rank) instead of all its
weights; the ref is then its base, with the adapter off.

Not a bench of the harness's kind (one run, no variants to interleave): a learning
check as far as 2 cores allow. Run: `.venv/bin/python -m bench.real_model.grpo`
(after `make real-model`). Arguments, optional: steps (30), actor learning rate (1e-5),
LoRA rank (0: none, full fine-tuning), seed (0: the data order and the sampling).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter
from tests.real_model import real_model_job, sums_dataset

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
LEARNING_RATE = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-5
LORA_RANK = (int(sys.argv[3]) or None) if len(sys.argv) > 3 else None
SEED = int(sys.argv[4]) if len(sys.argv) > 4 else 0
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAIN_QUESTIONS, HELD_OUT = 64, 24
PROMPTS, ANSWERS = 8, 4  # a step: 8 questions, 4 answers each
EVAL_EVERY = 10


def job(tmp: Path) -> JobConfig:
    train = sums_dataset(tmp / "train.parquet", TRAIN_QUESTIONS)
    held_out = sums_dataset(tmp / "held-out.parquet", HELD_OUT, first=TRAIN_QUESTIONS)
    base = real_model_job(
        train, tmp / "checkpoints", total_steps=STEPS, batch=PROMPTS, max_response_length=24
    )
    spec = base.to_dict()
    spec["roles"].pop("critic")
    spec["algorithm"] = {"advantageEstimator": "grpo", "klCoef": 0.01}
    spec["generation"]["samplesPerPrompt"] = ANSWERS
    spec["data"]["eval"] = str(held_out)
    spec["trainer"].update(
        evalEverySteps=EVAL_EVERY,
        miniBatchSize=PROMPTS * ANSWERS,
        microBatchSize=8,
        actorLearningRate=LEARNING_RATE,
        seed=SEED,
    )
    if LORA_RANK is not None:
        lora = {"rank": LORA_RANK, "alpha": 2 * LORA_RANK, "targetModules": LINEAR}
        spec["models"]["actor"]["lora"] = lora
    return JobConfig.model_validate(spec)


def main() -> None:
    steps: list[StepResult] = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        config = job(Path(tmp))
        with local_ray_cluster(config):
            run_job(config, "grpo-sums", ConsoleReporter(every=1e9), on_step=steps.append)
    evaluations = sorted((e for s in steps for e in s.evaluations), key=lambda e: e.step)
    record = {
        "bench": "real_model_grpo",
        "steps": STEPS,
        "actor_learning_rate": LEARNING_RATE,
        "lora_rank": LORA_RANK,
        "seed": SEED,
        "held_out_questions": HELD_OUT,
        "wall_s": round(time.time() - started, 1),
        "step_s": round(sum(s.seconds for s in steps[1:]) / max(1, len(steps) - 1), 2),
        "train_reward_first_5": round(sum(s.reward_mean for s in steps[:5]) / 5, 3),
        "train_reward_last_5": round(sum(s.reward_mean for s in steps[-5:]) / 5, 3),
        "held_out_pass_at_1": {e.step: round(e.pass_at_1, 3) for e in evaluations},
        "held_out_length": {e.step: round(e.response_length_mean, 1) for e in evaluations},
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
