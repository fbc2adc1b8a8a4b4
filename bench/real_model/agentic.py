"""Benchmark: does the real instruct model learn to call a tool, and to answer better?

SmolLM2-135M-Instruct plays rlhf_env.toys:Calculator episodes (bench/real_model/
calculator.py builds the job: GRPO, no critic, maxTurns 3, every role on one simulated
GPU, fp32) in the tool-call format the probe found it writes most (tool_formats.py:
FORMAT, its chat template given as multiTurn.chatTemplate, its vLLM tool parser). Two
variants, interleaved within each seed (trainer.seed 0, 1, 2: the data order and the
sampling), on the same episodes and the same evaluation:
    trained   actor learning rate LEARNING_RATE
    control   actor learning rate 1e-12 (the spec refuses 0): the same run, nothing learnt
Shaping: a training row carries call_reward CALL_REWARD, the Calculator's per-turn
reward for the first turn whose every call is valid (the calculate tool, an expression
it evaluates), added at that turn's last token (turnRewardDiscount 1). The task reward
(the environment's score: 1 for the sum alone as the answer) is reported unshaped.

Reported per variant, as median (min-max) over the seeds, from the held-out questions
(disjoint from the trained ones) played before training and after the last step, each
EVAL_SAMPLES times at temperature 1:
    calls_before / calls_after     the share of episodes with a valid tool call (a call
                                   vLLM's parser read: the evaluation's tool-call rate)
    reward_before / reward_after   the task reward (mean score)
    seconds                        the run's wall-clock, start-up included
and per seed the trained run's gains less the control's (calls_gain_vs_control,
reward_gain_vs_control); on stderr a line per run.

Run: make bench-real-agentic (after make real-model). Arguments, optional: steps
(4), seeds (3; fewer runs them without a median's minimum), learning rate (2e-5), the
first seed (0), the variants to run (trained,control; one of them alone runs that arm
only, without the comparison: to redo one run of a seed, e.g. `python -m
bench.real_model.agentic 4 1 2e-5 1 control`).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from bench.harness import Measurement, figures, run_bench
from bench.real_model.calculator import Episodes, job, play
from bench.real_model.tool_formats import FORMATS, chat_template
from rlhf_trainer.api.config import JobConfig

FORMAT = "pythonic"
DEMONSTRATION = True  # one worked exchange before each question (tool_formats.py)
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
SEEDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
LEARNING_RATE = float(sys.argv[3]) if len(sys.argv) > 3 else 2e-5
FIRST_SEED = int(sys.argv[4]) if len(sys.argv) > 4 else 0
ARMS = sys.argv[5].split(",") if len(sys.argv) > 5 else ["trained", "control"]
CONTROL_RATE = 1e-12
CALL_REWARD = 0.5
EVAL_SAMPLES = 4
PLAYS = Episodes(
    train_questions=32,
    held_out=8,
    prompts=4,
    answers=4,
    turn_tokens=32,
    chat_template=chat_template(FORMAT),
    template_kwargs=(("demonstration", DEMONSTRATION),),
    tool_parser=FORMATS[FORMAT].parser,
    call_reward=CALL_REWARD,
)

SEEN: dict[str, int] = {}  # variant -> runs so far (its next seed)


def train(variant: str, learning_rate: float) -> Measurement:
    """The variant's next seed: held-out calls and reward before and after training."""
    seed = SEEN.get(variant, FIRST_SEED)
    SEEN[variant] = seed + 1
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        plays = Episodes(**{**vars(PLAYS), "seed": seed})
        spec = job(Path(tmp), STEPS, learning_rate, plays).to_dict()
        spec["generation"]["eval"] = {"samplesPerPrompt": EVAL_SAMPLES, "temperature": 1.0}
        steps, evaluations = play(JobConfig.model_validate(spec), "agentic")
    before, after = evaluations[0], evaluations[-1]
    assert before.step == 0, "no held-out evaluation before training"
    measured = {
        "calls_before": before.tool_call_rate or 0.0,
        "calls_after": after.tool_call_rate or 0.0,
        "reward_before": before.reward_mean,
        "reward_after": after.reward_mean,
        "seconds": time.time() - started,
    }
    train_calls = [round(s.episodes.tool_call_rate, 2) if s.episodes else None for s in steps]
    shown = ", ".join(f"{key} {value:.3f}" for key, value in measured.items())
    line = f"run: {variant} seed {seed}, {len(steps)} steps: {shown}; training calls {train_calls}"
    print(line, file=sys.stderr, flush=True)
    return measured


def compare(run: dict[str, Measurement]) -> Measurement:
    """Within one seed, the trained run's gains less the control's."""

    def gain(variant: str, figure: str) -> float:
        return run[variant][f"{figure}_after"] - run[variant][f"{figure}_before"]

    return {
        f"{figure}_gain_vs_control": gain("trained", figure) - gain("control", figure)
        for figure in ("calls", "reward")
    }


def main() -> None:
    rates = {"trained": LEARNING_RATE, "control": CONTROL_RATE}
    variants = {arm: partial(train, arm, rates[arm]) for arm in ARMS}
    both = set(variants) == set(rates)  # the comparison needs the pair
    settings = {
        "steps": STEPS,
        "format": FORMAT,
        "learning_rate": LEARNING_RATE,
        "call_reward": CALL_REWARD,
        "eval_samples": EVAL_SAMPLES,
    }
    if SEEDS >= 3:
        run_bench("real_agentic", variants, SEEDS, compare if both else None, **settings)
        return
    runs = [{name: variant() for name, variant in variants.items()} for _ in range(SEEDS)]
    # Fewer seeds than a median needs: shown as they are.
    spreads = figures(runs, compare if both else None)
    record = {
        "bench": "real_agentic",
        "repeats": SEEDS,
        **settings,
        "figures": {key: spread.to_json() for key, spread in spreads.items()},
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
