"""`rlhfjob export --spec` for a checkpoint that does not keep the job's config takes the
job's spec in each form the docs name: the RLHFJob manifest, the job's spec ConfigMap as
kubectl prints it (`<job>-spec`, as the operator renders it), or that ConfigMap's
spec.json key; anything else is refused naming the file and those forms. The export
runs in this process (the command `rlhfjob export` hands it): ~5 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from rlhf_operator.app import cli
from rlhf_operator.render.children import SPEC_FILE, JobRef, render_spec_configmap
from rlhf_trainer import export
from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.roles import checkpoint

MANIFEST = Path(__file__).parents[2] / "examples" / "local-cpu.yaml"


def checkpoint_without_config(root: Path) -> Path:
    """A committed checkpoint of the example's actor with no job.json (an older one)."""
    jobs, problems = cli.read_jobs(MANIFEST)
    assert not problems
    tiny = jobs[0].spec.job_config(jobs[0].metadata.name).models.actor.tiny
    assert tiny is not None
    staging = checkpoint.staging_dir(root, 1)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp_save({"model": build_tiny_model(tiny, seed=1).state_dict()},
                 checkpoint_id=staging / "actor", no_dist=True)  # fmt: skip
    checkpoint.save_trainer_state(
        staging, checkpoint.TrainerState(1, 1, 0, 0, checkpoint.capture_rng())
    )
    return checkpoint.commit(root, 1)


def spec_forms(tmp_path: Path) -> dict[str, Path]:
    """The job's spec as a manifest, as its ConfigMap (kubectl -o yaml) and as the
    ConfigMap's spec.json key (kubectl -o jsonpath)."""
    jobs, _ = cli.read_jobs(MANIFEST)
    configmap = render_spec_configmap(JobRef(jobs[0].metadata.name, "ns", "uid"), jobs[0].spec)
    forms = {"configmap.yaml": yaml.safe_dump(configmap), SPEC_FILE: configmap["data"][SPEC_FILE]}
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
    return {"manifest": MANIFEST} | {name: tmp_path / name for name in forms}


def test_rlhfjob_export_takes_the_spec_as_manifest_configmap_or_its_spec_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = checkpoint_without_config(tmp_path / "checkpoints")
    monkeypatch.setattr(cli, "run_in_foreground", lambda command: export.main(command[3:]))
    assert cli.main(["export", str(source), str(tmp_path / "hf")]) == 1
    assert "give the job's spec (--spec)" in capsys.readouterr().err
    for form, spec in spec_forms(tmp_path).items():
        target = tmp_path / f"hf-{form}"
        assert cli.main(["export", str(source), str(target), "--spec", str(spec)]) == 0, form
        printed = capsys.readouterr().out
        assert "the policy of step 1 in bf16" in printed
        assert f"serve it with: vllm serve {target} --tokenizer {target}/tokenizer" in printed
        assert (target / "model.safetensors").is_file()


def test_a_spec_in_no_such_form_is_refused_naming_the_forms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "step-00000001"  # never read: the spec is refused first
    for name, doc in {
        "other.yaml": {"kind": "ConfigMap", "data": {"other": "{}"}},
        "bad.json": {"models": {"actor": {}}},
    }.items():
        (tmp_path / name).write_text(json.dumps(doc))
        assert cli.main(["export", str(source), str(tmp_path / "hf"), "--spec",
                         str(tmp_path / name)]) == 1  # fmt: skip
        assert f"{tmp_path / name}: " in (printed := capsys.readouterr().out)
        assert "an RLHFJob manifest, the job's spec ConfigMap" in printed
