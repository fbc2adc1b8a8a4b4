"""The real instruct model with a calculator tool, judged on sums it never trains on.

SmolLM2-135M-Instruct (tests/real_model.py) plays rlhf_env.toys:Calculator episodes:
the question asks for the sum of two numbers and offers the `calculate` tool; the
episode ends at the first turn without a tool call, scored 1 when that turn is the sum
alone. At most 3 turns (maxTurns 3), each of up to 48 tokens. The Calculator is served
by its class (environments[].serve): the local run starts it in a process of its own.
GRPO (4 episodes of each of 4 questions a step, no critic), klCoef 0.01, every role on
one simulated GPU, fp32. The training and held-out questions are disjoint (the addends
of tests.real_model.sums_dataset's sums).

The chat template is ours, not the model's: SmolLM2's own (chat_template.jinja beside
its weights) ignores `tools` and renders neither tool calls nor tool messages, so the
model would never see the tool. The run uses a copy of the model directory (weights
symlinked, the cached model untouched) whose template is ChatML in the Hermes/Qwen2.5
style: the tools listed in the system message inside <tools></tools>, a call written
as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (what vLLM's "hermes" tool
parser reads), tool results as a user turn of <tool_response></tool_response> blocks.
The model was never trained on this format: whether it calls the tool at all is the
first thing measured.

Reported, before and after training, on the held-out questions answered greedily (the
job's evaluation, which plays them as episodes): accuracy (the environment's score,
pass@1) and the tool-call rate (episodes with at least one tool call / episodes), both
from the evaluation's own report; and the training reward and tool-call rate over the
first and last steps.

Run: `.venv/bin/python -m bench.real_model.calculator [steps] [lr]` (after `make
real-model`). Arguments, optional: steps (10), actor learning rate (1e-5).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.real_model.tool_formats import chat_template
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.progress import EvalProgress
from rlhf_trainer.cluster.local import local_environments, local_ray_cluster
from rlhf_trainer.loop.run import run_job
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.report import ConsoleReporter
from tests.real_model import addends, real_model_dir, real_model_job

TRAIN_QUESTIONS, HELD_OUT = 32, 16
PROMPTS, ANSWERS = 4, 4  # a step: 4 questions, 4 episodes each
FIRST_LAST = 2  # steps averaged at each end of the run

# ChatML in the Hermes/Qwen2.5 style (tool_formats.py's "hermes" format, which the
# format probe shares): a message renders the same whatever follows it.
TOOL_TEMPLATE = chat_template("hermes")


def tool_model(directory: Path) -> Path:
    """A copy of the real model's directory under `directory`, weights and tokenizer
    symlinked, with TOOL_TEMPLATE as its chat template."""
    model = directory / "SmolLM2-135M-Instruct-tools"
    model.mkdir()
    for file in real_model_dir().iterdir():
        if file.name != "chat_template.jinja":
            (model / file.name).symlink_to(file)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return model


def calculator_rows(
    path: Path, count: int, first: int = 0, call_reward: float | None = None
) -> Path:
    """Rows of the Calculator environment, `{"numbers": [a, b]}`, with the addends of
    tests.real_model.sums (so two ranges share no question). The `prompt` column is
    only what the data loader requires; the environment writes the question.
    `call_reward`: the Calculator's per-turn reward for a first valid call (shaping)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shaping = {} if call_reward is None else {"call_reward": call_reward}
    rows = [
        {"prompt": f"{a} + {b}", "numbers": [a, b], **shaping} for a, b in addends(count, first)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@dataclass(frozen=True)
class Episodes:
    """What a run plays: its questions, its batch, its turns, its format."""

    train_questions: int = TRAIN_QUESTIONS
    held_out: int = HELD_OUT
    prompts: int = PROMPTS  # questions a step
    answers: int = ANSWERS  # episodes a question
    turn_tokens: int = 48
    chat_template: str | None = None  # None: TOOL_TEMPLATE in a copy of the model
    template_kwargs: tuple[tuple[str, bool], ...] = ()  # multiTurn.chatTemplateKwargs
    tool_parser: str = "hermes"
    call_reward: float | None = None  # the Calculator's shaping reward (training rows)
    seed: int = 0


def job(tmp: Path, steps: int, learning_rate: float, plays: Episodes = Episodes()) -> JobConfig:
    """GRPO on Calculator episodes (the module doc), every role on one simulated GPU."""
    rows = calculator_rows(tmp / "train.parquet", plays.train_questions, 0, plays.call_reward)
    held_out = calculator_rows(tmp / "held-out.parquet", plays.held_out, plays.train_questions)
    base = real_model_job(
        rows,
        tmp / "checkpoints",
        total_steps=steps,
        batch=plays.prompts,
        max_response_length=plays.turn_tokens,
    )
    spec = base.to_dict()
    spec["roles"].pop("critic")
    model = real_model_dir() if plays.chat_template else tool_model(tmp)
    spec["models"] = {"actor": {"path": str(model)}, "reward": {"environment": True}}
    spec["environments"] = [{"name": "calculator", "serve": "rlhf_env.toys:Calculator"}]
    spec["algorithm"] = {"advantageEstimator": "grpo", "klCoef": 0.01}
    spec["generation"].update(
        samplesPerPrompt=plays.answers,
        # The prompt (tools listed in the system message) is ~250 tokens; room for 3 turns.
        multiTurn={
            "environment": "calculator",
            "toolParser": plays.tool_parser,
            "maxTurns": 3,
            "maxTokens": 768,
            "chatTemplateKwargs": dict(plays.template_kwargs),
            **({"chatTemplate": plays.chat_template} if plays.chat_template else {}),
        },
    )
    spec["data"]["eval"] = str(held_out)
    spec["trainer"].update(
        evalEverySteps=None,  # before training and after the last step only
        miniBatchSize=plays.prompts * plays.answers,
        microBatchSize=8,
        actorLearningRate=learning_rate,
        seed=plays.seed,
    )
    return JobConfig.model_validate(spec)


def train_tool_call_rate(step: StepResult) -> float:
    return step.episodes.tool_call_rate if step.episodes else 0.0


def show(step: StepResult) -> None:
    """A line per step on stderr, to watch the run."""
    rate = train_tool_call_rate(step)
    line = f"  step {step.step}: reward {step.reward_mean:.3f}, tool-call rate {rate:.3f}"
    print(f"{line}, {step.seconds:.1f} s", file=sys.stderr, flush=True)


def ends(steps: list[StepResult], value: Callable[[StepResult], float]) -> tuple[float, float]:
    """The mean of `value` over the first and the last FIRST_LAST steps."""
    first, last = steps[:FIRST_LAST], steps[-FIRST_LAST:]
    return (
        round(sum(map(value, first)) / len(first), 3),
        round(sum(map(value, last)) / len(last), 3),
    )


def play(config: JobConfig, name: str) -> tuple[list[StepResult], list[EvalProgress]]:
    """Runs the job, its environments served locally, a line a step on stderr; returns
    its steps and its held-out evaluations in step order."""
    steps: list[StepResult] = []

    def on_step(step: StepResult) -> None:
        steps.append(step)
        show(step)

    with local_environments(config) as config, local_ray_cluster(config):
        run_job(config, name, ConsoleReporter(every=1e9), on_step=on_step)
    evaluations = sorted((e for s in steps for e in s.evaluations), key=lambda e: e.step)
    return steps, evaluations


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    learning_rate = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-5
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        steps, evaluations = play(job(Path(tmp), total, learning_rate), "calculator")
    record = {
        "bench": "real_model_calculator",
        "steps": total,
        "actor_learning_rate": learning_rate,
        "held_out_questions": HELD_OUT,
        "wall_s": round(time.time() - started, 1),
        "step_s": round(sum(s.seconds for s in steps) / max(1, len(steps)), 1),
        "held_out_accuracy": {e.step: round(e.pass_at_1, 3) for e in evaluations},
        "held_out_tool_call_rate": {e.step: round(e.tool_call_rate or 0, 3) for e in evaluations},
        "held_out_length": {e.step: round(e.response_length_mean, 1) for e in evaluations},
        f"train_reward_first_last_{FIRST_LAST}": ends(steps, lambda s: s.reward_mean),
        f"train_tool_call_rate_first_last_{FIRST_LAST}": ends(steps, train_tool_call_rate),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
