"""A run killed mid-training resumes from its last checkpoint and carries on as if
nothing had happened.

The first run (`python -m rlhf_trainer --local`, the command a user runs) is killed
with SIGKILL, process group and all, a step or two after a checkpoint. The second run
must start from that checkpoint and replay the steps the first run made past it with
the same rewards, to the last digit: weights, optimizers, data position and sampling
seeds all came back. The run's KL coefficient is adaptive, so it moves every step: a
resumed run that started again from klCoef would log other coefficients, and other KLs.
The held-out prompts are evaluated after every step: none is repeated or skipped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.roles import checkpoint
from rlhf_trainer.telemetry.run_folder import RunFolder
from tests.specs import local_job

pytestmark = pytest.mark.slow  # each trains whole runs (minutes)

TOTAL_STEPS = 4
EVERY = 2
RUN_TIMEOUT_S = 600  # generous: starting the roles takes about a minute on 2 cores
TRAINER = [sys.executable, "-m", "rlhf_trainer"]
STEP_LINE = re.compile(r"step (\d+)/\d+: reward ([-\d.]+), kl ([-\d.]+) \(coef ([-\d.e]+)\)")
EVAL_LINE = re.compile(r"held-out reward ([-\d.]+) at step (\d+)")
# A target far from the toy run's KL and a horizon under one step: the coefficient moves
# by 20% every step.
ADAPTIVE_KL = {"type": "adaptive", "targetKL": 1e-6, "horizon": 1}


def rewards(log: str) -> dict[int, tuple[str, str, str]]:
    """step -> (reward, KL, KL coefficient), as logged."""
    return {int(step): (reward, kl, coef) for step, reward, kl, coef in STEP_LINE.findall(log)}


def evaluations(log: str) -> dict[int, str]:
    """step -> held-out reward, as logged; a repeated step would repeat its line."""
    found = [(int(step), reward) for reward, step in EVAL_LINE.findall(log)]
    assert len({step for step, _ in found}) == len(found), found
    return dict(found)


def start(spec: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            # the run folder beside the spec, not under the working directory
            [*TRAINER, "--spec", str(spec), "--local", "--run-dir", str(spec.parent / "run")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the kill takes Ray with it
        )


def kill_after_a_step_past_a_checkpoint(run: subprocess.Popen[bytes], root: Path, log: Path) -> int:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        latest = checkpoint.latest(root)
        saved = checkpoint.step_of(latest) if latest else 0
        if saved >= EVERY and max(rewards(log.read_text()), default=0) > saved:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            return saved
        assert run.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    raise AssertionError("no checkpoint followed by a step in time:\n" + log.read_text()[-3000:])


def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    spec = local_job(
        colocated=True, total_steps=TOTAL_STEPS, checkpoint_dir=root, every_steps=EVERY
    ).to_dict()
    spec["algorithm"]["klController"] = ADAPTIVE_KL
    spec["trainer"]["evalEverySteps"] = 1  # the held-out prompts, after every step
    config = JobConfig.model_validate(spec)
    spec = tmp_path / "spec.json"
    spec.write_text(config.model_dump_json(by_alias=True, exclude_none=True))

    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    saved = kill_after_a_step_past_a_checkpoint(start(spec, first_log), root, first_log)
    first = rewards(first_log.read_text())
    assert saved < TOTAL_STEPS

    second = start(spec, second_log)
    assert second.wait(timeout=RUN_TIMEOUT_S) == 0, second_log.read_text()[-3000:]
    output = second_log.read_text()
    assert f"at step {saved}" in output  # "resuming from <dir> at step N"
    resumed = rewards(output)
    assert sorted(resumed) == list(range(saved + 1, TOTAL_STEPS + 1))
    replayed = [step for step in first if step > saved]
    assert replayed, "the first run made no step past its checkpoint"
    assert {s: resumed[s] for s in replayed} == {s: first[s] for s in replayed}
    assert checkpoint.latest(root) == root / f"step-{TOTAL_STEPS:08d}"
    coefficients = [float(first[s][2]) for s in sorted(first)]
    assert len(set(coefficients)) == len(coefficients), coefficients

    # The checkpoint holds the evaluations reported up to its step: the resumed run
    # evaluates only after the steps it trains (again), with the same answers.
    evaluated_first, evaluated_again = evaluations(first_log.read_text()), evaluations(output)
    assert set(range(saved + 1)) <= set(evaluated_first)
    assert sorted(evaluated_again) == list(range(saved + 1, TOTAL_STEPS + 1))
    assert {s: evaluated_again[s] for s in evaluated_first if s > saved} == {
        s: r for s, r in evaluated_first.items() if s > saved
    }
    folder = RunFolder(tmp_path / "run")
    assert [e.step for e in folder.evaluations()] == list(range(TOTAL_STEPS + 1))
