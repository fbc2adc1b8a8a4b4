"""A run that dies mid-training resumes from its last checkpoint and carries on as if
nothing had happened.

The first run (`python -m rlhf_trainer --local`, the command a user runs) dies three
steps after a checkpoint: one of its ranks is SIGKILLed in the middle of a step, or
the whole run is, driver and all. A dead rank must end the run at once, non-zero,
naming the rank, its pool and its call, and leave no process behind. The second run
must start from the checkpoint and replay those steps with the same values, to the
last digit: rewards, KL, the actor's and the critic's losses and statistics, the
values' explained variance. The first replayed step trains from the restored weights,
optimizers and critic, and the next ones sample from what it trained, so a part that
did not come back changes every value after it. The run's KL coefficient is adaptive,
so it moves every step: a resumed run that started again from klCoef would log other
coefficients, and other KLs. The held-out prompts are evaluated after every step: none
is repeated or skipped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rlhf_trainer.algo.kl_control import next_kl_coef
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.roles import checkpoint
from rlhf_trainer.telemetry.run_folder import RunFolder, StepRecord
from tests.specs import local_async_job, local_job
from tests.trainer.local_runs import RUN_TAG, tagged_processes

pytestmark = pytest.mark.slow  # each trains whole runs (minutes)

TOTAL_STEPS = 8
EVERY = 4
REPLAYED = 3  # steps the first run makes past its checkpoint before it dies
RUN_TIMEOUT_S = 600  # generous: starting the roles takes about a minute on 2 cores
# From a rank's death to the run's exit: the other ranks are asked to stop (30 s of
# grace at most), then the local cluster goes. Generous for 2 busy cores.
DEATH_TO_EXIT_S = 180
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


def start(spec: Path, log: Path, tag: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            # the run folder beside the spec, not under the working directory
            [*TRAINER, "--spec", str(spec), "--local", "--run-dir", str(spec.parent / "run")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the kill takes Ray with it
            env=os.environ | {RUN_TAG: tag},  # inherited by every process of the run
        )


# role_groups.log_whereabouts' line for each rank 0: (role, pool, pid)
RANK_LINE = re.compile(r"(\w+) rank 0 on pool (\w+): pid (\d+) on node")


def rank_pid(log: str, role: str) -> tuple[int, str]:
    """(pid, pool) of the role's rank 0, from the line the run logs once it is placed."""
    found = [(int(pid), pool) for who, pool, pid in RANK_LINE.findall(log) if who == role]
    assert found, f"the run logged no process for {role} rank 0:\n{log[-3000:]}"
    return found[0]


def kill_steps_past_a_checkpoint(
    run: subprocess.Popen[bytes], root: Path, log: Path, victim: str
) -> int:
    """Once the run has made REPLAYED steps past a checkpoint, SIGKILL `victim`: a role's
    rank 0 ("actor", "critic"), which dies in the next step, or "run": the whole process
    group. Returns the step of the checkpoint."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    folder = RunFolder(root.parent / "run")
    while time.monotonic() < deadline:
        latest = checkpoint.latest(root)
        saved = checkpoint.step_of(latest) if latest else 0
        if saved >= EVERY and last_recorded_step(folder) >= saved + REPLAYED:
            if victim == "run":
                os.killpg(run.pid, signal.SIGKILL)
            else:
                os.kill(rank_pid(log.read_text(), victim)[0], signal.SIGKILL)
            return saved
        assert run.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    raise AssertionError(f"no checkpoint followed by {REPLAYED} steps:\n{log.read_text()[-3000:]}")


def last_recorded_step(folder: RunFolder) -> int:
    """The last step metrics.jsonl holds whole (its line comes after the step's log
    line; a line being written does not count yet)."""
    text = folder.metrics.read_text() if folder.metrics.is_file() else ""
    whole = text[: text.rfind("\n") + 1].splitlines()
    return max((json.loads(line)["step"] for line in whole if line.strip()), default=0)


def job(mode: str, root: Path) -> JobConfig:
    """The local example, synchronous and colocated, or split (the critic on a pool of
    its own), or fully async at staleness 0 in groups of 2: every sample then comes from
    the policy it trains (the batches do not depend on the engines' timing), and the
    checkpoint holds the next step's prompts, queued or in flight."""
    if mode.startswith("sync"):
        config = local_job(colocated=mode == "sync", total_steps=TOTAL_STEPS,
                           checkpoint_dir=root, every_steps=EVERY)  # fmt: skip
    else:
        config = local_async_job(staleness=0, total_steps=TOTAL_STEPS, checkpoint_dir=root,
                                 every_steps=EVERY, samples_per_prompt=2)  # fmt: skip
    spec = config.to_dict()
    spec["algorithm"]["klController"] = ADAPTIVE_KL
    spec["trainer"]["evalEverySteps"] = 1  # the held-out prompts, after every step
    return JobConfig.model_validate(spec)


@pytest.mark.parametrize(
    ("mode", "victim"), [("sync", "actor"), ("async", "critic"), ("sync-split", "run")]
)
def test_a_run_that_dies_resumes_from_its_last_checkpoint_and_replays_its_values(
    mode: str, victim: str, tmp_path: Path
) -> None:
    """The killed driver's run ("run") resumes on a bigger critic pool, 2 nodes where it
    had 1, as the next attempt of a resize does (loop.resize)."""
    root = tmp_path / "checkpoints"
    spec = tmp_path / "spec.json"
    config = job(mode, root)
    spec.write_text(config.model_dump_json(by_alias=True, exclude_none=True))
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    tag = f"{tmp_path.name}-{time.time()}"

    first_run = start(spec, first_log, tag)
    saved = kill_steps_past_a_checkpoint(first_run, root, first_log, victim)
    if victim != "run":
        assert_the_run_ends_naming_the_dead_rank(first_run, first_log, victim, tag)
    first_run.wait(timeout=DEATH_TO_EXIT_S)
    first = rewards(first_log.read_text())
    assert saved < TOTAL_STEPS
    folder = RunFolder(tmp_path / "run")
    killed_run = trained_values(folder)  # the resumed run drops its steps past the checkpoint

    resized = victim == "run"
    if resized:
        spec.write_text(grown(config, "value", 2).model_dump_json(by_alias=True, exclude_none=True))
    second = start(spec, second_log, tag)
    assert second.wait(timeout=RUN_TIMEOUT_S) == 0, second_log.read_text()[-3000:]
    output = second_log.read_text()
    assert f"at step {saved}" in output  # "resuming from <dir> at step N"
    resumed = rewards(output)
    assert sorted(resumed) == list(range(saved + 1, TOTAL_STEPS + 1))
    replayed = [step for step in first if step > saved]
    assert len(replayed) >= REPLAYED, f"the first run made {replayed} past its checkpoint"
    resumed_run = trained_values(folder)
    assert sorted(killed_run) == sorted(first) and sorted(resumed_run) == list(
        range(1, TOTAL_STEPS + 1)
    )
    if resized:
        assert re.search(r"critic rank 1 on pool value: pid \d+", output), output[-3000:]
        assert_the_next_step_samples_the_same_prompts_with_the_same_policy(
            saved + 1, first, resumed, killed_run, resumed_run
        )
    else:
        assert {s: resumed[s] for s in replayed} == {s: first[s] for s in replayed}
        assert {s: resumed_run[s] for s in replayed} == {s: killed_run[s] for s in replayed}
    assert_optimizers_count_every_update(root, saved)
    assert checkpoint.latest(root) == root / f"step-{TOTAL_STEPS:08d}"
    assert_the_kl_coefficient_follows_its_controller(config, resumed_run)

    # The checkpoint holds the evaluations reported up to its step: the resumed run
    # evaluates only after the steps it trains (again), with the same answers (on a
    # resized run, trained by other ranks, they may differ in the last digits).
    evaluated_first, evaluated_again = evaluations(first_log.read_text()), evaluations(output)
    assert set(range(saved + 1)) <= set(evaluated_first)
    assert sorted(evaluated_again) == list(range(saved + 1, TOTAL_STEPS + 1))
    if not resized:
        assert {s: evaluated_again[s] for s in evaluated_first if s > saved} == {
            s: r for s, r in evaluated_first.items() if s > saved
        }
    assert [e.step for e in folder.evaluations()] == list(range(TOTAL_STEPS + 1))


def grown(config: JobConfig, pool: str, replicas: int) -> JobConfig:
    spec = config.to_dict()
    next(p for p in spec["pools"] if p["name"] == pool)["replicas"] = replicas
    return JobConfig.model_validate(spec)


def assert_the_next_step_samples_the_same_prompts_with_the_same_policy(
    step: int,
    first: dict[int, Any],
    resumed: dict[int, Any],
    killed_run: dict[int, Any],
    resumed_run: dict[int, Any],
) -> None:
    """On 2 critic ranks instead of 1, the first step after the checkpoint samples the
    same prompts (the data position), with the same policy and random numbers: the same
    reward, KL and coefficient to the last digit. The critic's values come from other
    ranks and batches, equal within float rounding, and so do the advantages and the
    actor's update. The critic's own update weighs its micro-batches otherwise on 2
    ranks (its loss and gradient norm moved by 1.6% here); its explained variance, taken
    on the values before the update, does not. Later steps sample differently."""
    assert resumed[step] == first[step]
    reward, kl, coefficient, actor, critic, responses = resumed_run[step]
    assert (reward, kl, coefficient, responses) == (
        killed_run[step][0], killed_run[step][1], killed_run[step][2], killed_run[step][5]
    )  # fmt: skip
    before_actor, before_critic = killed_run[step][3], killed_run[step][4]
    assert asdict(actor) == pytest.approx(asdict(before_actor), rel=1e-3, abs=1e-6), actor
    assert critic.explained_variance == pytest.approx(
        before_critic.explained_variance, rel=1e-3, abs=1e-6, nan_ok=True
    )


def assert_the_run_ends_naming_the_dead_rank(
    run: subprocess.Popen[bytes], log: Path, role: str, tag: str
) -> None:
    """Non-zero within DEATH_TO_EXIT_S, the rank named, and not one of the run's
    processes left (Ray's, the ranks', vLLM's engine core)."""
    try:
        code = run.wait(timeout=DEATH_TO_EXIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise AssertionError(
            f"still running {DEATH_TO_EXIT_S} s after {role} rank 0 died"
        ) from None
    output = log.read_text()
    assert code != 0, output[-3000:]
    pid, pool = rank_pid(output, role)
    # The killed process's roles: the critic lives in the actor's (plan.in_actor_processes),
    # and whichever of their calls fails first is the rank named.
    hosted = [who for who, _, at in RANK_LINE.findall(output) if int(at) == pid]
    named = re.search(rf"RankDied: (\w+) rank 0 on pool {pool} \(\w+\) died", output)
    assert named and named.group(1) in hosted, (hosted, output[-3000:])
    deadline = time.monotonic() + 30  # a process that has been killed may take a moment
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"the run's processes left behind: {left}"


def assert_the_kl_coefficient_follows_its_controller(
    config: JobConfig, trained: dict[int, Any]
) -> None:
    """Each step's coefficient is the controller's answer to the step before: its
    coefficient and mean KL, over a batch of batchSize samples (algo.kl_control). The
    first is klCoef; ADAPTIVE_KL moves it every step, across the resume too."""
    algorithm, samples = config.algorithm, config.trainer.batch_size
    coefficients = [trained[step][2] for step in sorted(trained)]
    assert coefficients[0] == algorithm.kl_coef
    for step, coefficient in zip(sorted(trained)[1:], coefficients[1:], strict=True):
        _, kl, previous, *_ = trained[step - 1]
        expected = next_kl_coef(previous, kl, algorithm.kl_controller, samples)
        assert coefficient == pytest.approx(expected, rel=1e-12), (step, coefficients)
        assert coefficient != previous, (step, coefficients)


def trained_values(folder: RunFolder) -> dict[int, Any]:
    """step -> what the step trained and measured, as metrics.jsonl has it (all of it but
    the times and busy shares)."""

    def values(record: StepRecord) -> Any:
        return (record.reward_mean, record.kl, record.kl_coef, record.actor, record.critic,
                record.responses)  # fmt: skip

    return {record.step: values(record) for record in folder.records()}


def assert_optimizers_count_every_update(root: Path, saved: int) -> None:
    """Adam counts its updates per parameter. The final checkpoint's count is the whole
    run's, twice the count at step TOTAL_STEPS / 2: the resumed run went on from the
    restored optimizers, not from fresh ones (that would count only its own steps)."""
    for role in ("actor", "critic"):
        counts = {step: adam_steps(root / checkpoint.committed_name(step) / role)
                  for step in (saved, TOTAL_STEPS)}  # fmt: skip
        assert counts[saved] > 0 and counts[TOTAL_STEPS] == counts[saved] * TOTAL_STEPS / saved, (
            role, counts)  # fmt: skip


def adam_steps(role_state: Path) -> int:
    """The optimizer's update count in a role's checkpoint (DCP), the same for every
    parameter."""
    whole = role_state.parents[1].parent / f"{role_state.parent.name}-{role_state.name}.pt"
    dcp_to_torch_save(role_state, whole)
    state = torch.load(whole, weights_only=False)["optimizer"]["state"]
    (count,) = {int(parameter["step"]) for parameter in state.values()}
    return count
