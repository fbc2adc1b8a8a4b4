"""`rlhfjob train` as a person runs it, in a real terminal (tmux): the live bar, Ctrl-C
saving a checkpoint, the same command resuming from it, and the run folder it leaves;
then `rlhfjob export` of its last checkpoint, which gives the trained actor's logits
(and the Ctrl-C checkpoint's export does not, so the comparison can fail) and, served by
vLLM, the actor's greedy answers to the held-out prompts; and the policy the run itself
wrote at its end (runs/<job>/model), the same weights in bf16.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import build_tokenizer, position_ids
from tests.conftest import needs
from tests.exports import (
    actor_greedy,
    assert_export_holds,
    checkpoint_actor,
    held_out_prompts,
    vllm_greedy,
)
from tests.specs import local_job

pytestmark = [
    pytest.mark.slow,  # two local runs, each starting Ray, vLLM and the roles
    needs(
        None
        if shutil.which("tmux")
        else "tmux is not installed (make install installs it with apt-get)"
    ),
]

TOTAL_STEPS = 12
PROMPTS = ["c a f e =", "b a d =", "f a c e d =", "a b c d e f ="]  # the logits compared
MAX_TOKENS = 16  # the example's maxResponseLength
RUN_TIMEOUT_S = 300  # starting the roles takes about 40 s on 2 cores
EXIT = re.compile(r"EXIT STATUS (\d+)")
INTERRUPTED = re.compile(
    r"interrupted at step (\d+): checkpoint saved to (\S+); run the same command again to resume"
)


class Terminal:
    """A tmux session on a server of its own, so it inherits this process's environment."""

    def __init__(self, name: str, cwd: Path) -> None:
        self.name = name
        self.cwd = cwd
        self.runs = 0

    @property
    def socket(self) -> str:
        # A server per command: a killed one may still be exiting when the next starts
        # (seen under load: new-session failed against the dying server).
        return f"{self.name}-{self.runs}"

    def tmux(self, *args: str) -> str:
        command = ["tmux", "-L", self.socket, "-f", "/dev/null", *args]
        # This process may carry COLUMNS and LINES (80 and 24 here, under pytest): the
        # pane's programs would believe them over the terminal's own size.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        assert done.returncode == 0, f"{shlex.join(command)}: {done.stderr}"
        return done.stdout

    def run(self, command: list[str]) -> None:
        """Run the command in a new window 250 columns wide, then print its exit status."""
        shell = f"cd {shlex.quote(str(self.cwd))} && {shlex.join(command)}; echo EXIT STATUS $?"
        if self.running():  # the previous command's session
            self.tmux("kill-server")
        self.runs += 1
        # bash, not sh: it waits for a child that handles Ctrl-C, and carries on after it
        self.tmux("new-session", "-d", "-x", "250", "-y", "50", "bash", "-c", shell + "; sleep 600")

    def running(self) -> bool:
        command = ["tmux", "-L", self.socket, "has-session"]
        return subprocess.run(command, capture_output=True).returncode == 0

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-S", "-1000")

    def wait_for(self, pattern: re.Pattern[str]) -> re.Match[str]:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            if found := pattern.search(self.screen()):
                return found
            time.sleep(0.1)
        raise AssertionError(f"no {pattern.pattern!r} in time:\n{self.screen()}")


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    session = Terminal(f"rlhf-test-{tmp_path.name}", tmp_path)
    yield session
    if session.running():
        session.tmux("kill-server")


def tiny_manifest(tmp_path: Path) -> Path:
    """The local example, colocated, with short steps and the default checkpoint path
    (so the checkpoints go to the run folder) and no scheduled checkpoint before the end:
    the one to resume from is the one Ctrl-C takes."""
    job = local_job(colocated=True, total_steps=TOTAL_STEPS, checkpoint_dir=tmp_path, every_steps=1)
    spec = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    spec["trainer"] |= {"batchSize": 4, "miniBatchSize": 4}
    spec["trainer"]["checkpoint"] = {"everySteps": TOTAL_STEPS}
    manifest = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob"}
    manifest |= {"metadata": {"name": "tiny"}, "spec": spec}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_ctrl_c_checkpoints_the_same_command_resumes_and_the_export_is_the_policy(
    terminal: Terminal, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "rlhf_operator.app.cli", "train", str(tiny_manifest(tmp_path))]
    run = tmp_path / "runs" / "tiny"  # the default run folder, under the working directory

    terminal.run(command)
    terminal.wait_for(re.compile(rf"step +[2-9]/{TOTAL_STEPS} .*\n.*samples/s · busy policy \d+%"))
    terminal.tmux("send-keys", "C-c")
    assert terminal.wait_for(EXIT)[1] == "130", terminal.screen()
    first = terminal.screen()
    interrupted = INTERRUPTED.search(first)
    assert interrupted, first
    step, saved = interrupted.groups()
    assert saved == f"runs/tiny/checkpoints/step-{int(step):08d}"
    assert (tmp_path / saved / "trainer_state.json").is_file()
    assert f"run folder: {run.resolve()}" in first
    assert "Traceback" not in first
    assert steps_in(run) == list(range(1, int(step) + 1))
    assert "not written: the run stopped before its end" in " ".join(first.split())
    assert not (run / "model").exists()

    terminal.run(command)
    assert terminal.wait_for(EXIT)[1] == "0", terminal.screen()
    second = terminal.screen()
    assert f"resuming from {saved} at step {step}" in second
    assert "Run summary" in second
    assert steps_in(run) == list(range(1, TOTAL_STEPS + 1))  # no step twice
    assert (run / "checkpoints" / f"step-{TOTAL_STEPS:08d}").is_dir()
    assert json.loads((run / "trace.json").read_text())["traceEvents"]
    for chart in ("reward_kl.png", "pool_busy.png"):
        with Image.open(run / chart) as image:
            assert image.format == "PNG" and image.size == (800, 450)
            image.verify()
    assert_the_export_is_the_trained_policy(run / "checkpoints", int(step), tmp_path)
    assert_the_runs_own_export_is_the_last_checkpoints_policy(run, tmp_path)
    assert re.search(r"model .*Hugging Face, bf16, step", " ".join(second.split())), second


def assert_the_runs_own_export_is_the_last_checkpoints_policy(run: Path, tmp: Path) -> None:
    """The run wrote its trained policy at its end, gathered from the actor's ranks
    (not read from a checkpoint): the last checkpoint's actor weights, in bf16."""
    tiny = JobConfig.model_validate(yaml.safe_load((tmp / "tiny.yaml").read_text())["spec"])
    assert tiny.models.actor.tiny is not None
    last = run / "checkpoints" / f"step-{TOTAL_STEPS:08d}"
    assert_export_holds(run / "model", checkpoint_actor(tiny.models.actor.tiny, last, tmp),
                        torch.bfloat16)  # fmt: skip


def assert_the_export_is_the_trained_policy(checkpoints: Path, interrupted: int, tmp: Path) -> None:
    """`rlhfjob export` of the last checkpoint, loaded by transformers, gives the logits
    of that checkpoint's actor weights in the project's own model class (read back by
    torch's DCP converter, not by the export's reader); the export of the checkpoint
    Ctrl-C took does not."""
    last, earlier = (checkpoints / f"step-{s:08d}" for s in (TOTAL_STEPS, interrupted))
    spec = yaml.safe_load((tmp / "tiny.yaml").read_text())["spec"]
    tiny = JobConfig.model_validate(spec).models.actor.tiny
    assert tiny is not None
    trained = checkpoint_actor(tiny, last, tmp)
    actor = logits(trained, tiny.vocab_size)
    served, stale = (export(checkpoint, tmp / f"hf-{checkpoint.name}", tmp)
                     for checkpoint in (last, earlier))  # fmt: skip
    torch.testing.assert_close(logits(served, tiny.vocab_size), actor, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(logits(stale, tiny.vocab_size), actor, rtol=1e-5, atol=1e-5)
    # vLLM serves the export: its greedy answers to the held-out prompts are the actor's.
    prompts = held_out_prompts(JobConfig.model_validate(spec))
    eos = int(served.generation_config.eos_token_id)
    answers = vllm_greedy(tmp / f"hf-{last.name}", prompts, MAX_TOKENS)
    assert answers == actor_greedy(trained, prompts, MAX_TOKENS, eos)
    assert len(set(map(tuple, answers))) > 1, answers  # not one answer for every prompt


def export(checkpoint: Path, directory: Path, cwd: Path) -> PreTrainedModel:
    command = [sys.executable, "-m", "rlhf_operator.app.cli", "export", str(checkpoint),
               str(directory), "--dtype", "fp32"]  # fmt: skip
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert f"the policy of step {int(checkpoint.name.split('-')[1])} in fp32" in done.stdout
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def logits(model: PreTrainedModel, vocab_size: int) -> Tensor:
    """(B, T, V) logits on PROMPTS, left-padded as the trainer pads them."""
    batch = build_tokenizer(vocab_size)(PROMPTS, return_tensors="pt", padding=True)
    mask = batch.attention_mask
    with torch.no_grad():
        out: Tensor = model(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids(mask)
        ).logits
    return out * mask.unsqueeze(-1)  # padding's logits are not the policy's


def steps_in(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]
