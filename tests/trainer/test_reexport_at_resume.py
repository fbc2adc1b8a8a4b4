"""A job resumed at its last step (its final checkpoint was committed, then the attempt
died, before or after its export) trains nothing and writes its policy to output
again: the actor's export of that step, replacing whatever the attempt before left
there, and its status names it. The actor is a stand-in whose rank 0 writes the real
export (roles.hf_export) of a tiny model: ~2 s."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.loop import run as run_module
from rlhf_trainer.loop.run import Run
from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.roles.hf_export import Export, write_policy
from tests.specs import local_job
from tests.trainer.local_runs import KeptReports

TOTAL = 3


class ActorRanks:
    """The actor's two ranks: rank 0 writes the export of the weights it holds."""

    def __init__(self, config: JobConfig, seed: int) -> None:
        assert config.models.actor.tiny is not None
        self.weights = build_tiny_model(config.models.actor.tiny, seed=seed).state_dict()
        self.config, self.calls = config, list[tuple[Any, ...]]()

    def run(self, method: str, *args: Any) -> list[Export | None]:
        assert method == "export"
        self.calls.append(args)
        path, dtype, step, adapter = args
        actor = self.config.models.actor
        done = write_policy(self.weights, actor, Path(path), dtype, step, "actor", seed=0,
                            adapter=adapter)  # fmt: skip
        return [done, None]


def resumed_run(config: JobConfig, actor: ActorRanks, reporter: KeptReports) -> Run:
    engines = SimpleNamespace(last_failed_sync=None)
    trainer: Any = SimpleNamespace(policy_version=TOTAL, engines=engines,
                                   groups={Role.ACTOR: actor})  # fmt: skip
    run = Run(config, trainer, metrics=None, reporter=reporter, step=TOTAL)  # type: ignore[arg-type]
    run.last_checkpoint = f"/checkpoints/step-{TOTAL:08d}"
    return run


def job(tmp_path: Path, output: bool) -> JobConfig:
    config = local_job(colocated=True, total_steps=TOTAL, checkpoint_dir=tmp_path / "ckpt",
                       every_steps=TOTAL)  # fmt: skip
    wire = config.model_dump(by_alias=True, exclude_none=True)
    if output:
        wire["output"] = {"path": str(tmp_path / "model")}
    return JobConfig.model_validate(wire)


@pytest.mark.parametrize("before", ["none", "an export of the step, left by the attempt"])
def test_a_run_resumed_at_its_last_step_writes_its_policy_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str
) -> None:
    monkeypatch.setattr(run_module, "join", lambda refs, *_, **__: list(refs))
    config = job(tmp_path, output=True)
    target = tmp_path / "model"
    if before != "none":  # other weights: the resumed export must replace them whole
        ActorRanks(config, seed=9).run("export", str(target), None, TOTAL, False)
    actor, reporter = ActorRanks(config, seed=1), KeptReports()
    final = resumed_run(config, actor, reporter).train()
    assert actor.calls == [(str(target), None, TOTAL, False)]
    assert final.output is not None
    assert (final.output.path, final.output.step, final.output.dtype) == (
        str(target),
        TOTAL,
        "bf16",
    )
    assert reporter.reports == [(final, True)]
    written = AutoModelForCausalLM.from_pretrained(target, dtype="auto").state_dict()
    for name, weight in actor.weights.items():
        assert (written[name] == weight.bfloat16()).all(), name


def test_a_run_resumed_at_its_last_step_without_output_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_module, "join", lambda refs, *_, **__: list(refs))
    config = job(tmp_path, output=False)
    actor = ActorRanks(config, seed=1)
    final = resumed_run(config, actor, KeptReports()).train()
    assert actor.calls == [] and final.output is None
