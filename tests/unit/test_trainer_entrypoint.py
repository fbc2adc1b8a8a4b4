"""The driver entry point reads the spec the operator hands over, or says what is wrong."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.__main__ import in_run_folder, main
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.telemetry.run_folder import RunFolder
from tests.unit.conftest import EXAMPLES, load


def handed_over_spec(tmp_path: Path, name: str = "split-8gpu-4-4.yaml") -> Path:
    spec = parse_job(load(EXAMPLES[0].parent / name)).spec.job_config()
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json(by_alias=True, exclude_none=True))
    return path


def test_dry_run_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--spec", str(handed_over_spec(tmp_path)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mode: split, 8 GPUs in 2 pool(s)" in out
    assert "update      actor-rollout-ref: update_actor || critic: update_critic" in out


def test_outside_a_ray_cluster_it_says_to_use_local(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["--spec", str(handed_over_spec(tmp_path))]) == 2
    assert "no Ray cluster to join" in capsys.readouterr().err


def test_a_bad_spec_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = handed_over_spec(tmp_path)
    spec = json.loads(path.read_text())
    spec["roles"]["critic"] = "elsewhere"
    path.write_text(json.dumps(spec))
    assert main(["--spec", str(path), "--dry-run"]) == 2
    assert "spec.roles.critic: must name a pool declared in spec.pools" in capsys.readouterr().err


def test_a_missing_spec_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--spec", "/no/spec.json", "--dry-run"]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad local settings must fail before the local Ray cluster starts."""

    def refuse(config: object) -> None:
        raise AssertionError("the local Ray cluster was started")

    monkeypatch.setattr("rlhf_trainer.cluster.local.local_ray_cluster", refuse)


@pytest.mark.usefixtures("no_ray")
def test_an_unwritable_run_folder_fails_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_dir = blocker / "run"
    assert (
        main(["--spec", str(handed_over_spec(tmp_path)), "--local", "--run-dir", str(run_dir)]) == 2
    )
    assert f"run folder {run_dir}: cannot write to it: Not a directory" in capsys.readouterr().err


@pytest.mark.usefixtures("no_ray")
def test_a_metrics_port_in_use_fails_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = str(handed_over_spec(tmp_path))
        run_dir = str(tmp_path / "run")
        assert (
            main(["--spec", spec, "--local", "--run-dir", run_dir, "--metrics-port", str(port)])
            == 2
        )
    assert f"metrics port {port} is in use" in capsys.readouterr().err


def test_the_run_folder_is_for_local_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--spec", str(handed_over_spec(tmp_path)), "--run-dir", str(tmp_path)]) == 2
    assert "--run-dir is for local runs (--local)" in capsys.readouterr().err


def test_local_checkpoints_and_model_go_to_the_run_folder_unless_the_spec_names_paths(
    tmp_path: Path,
) -> None:
    folder = RunFolder(tmp_path / "run")
    default = JobConfig.model_validate_json(handed_over_spec(tmp_path).read_text())
    assert default.trainer.checkpoint.path is None  # no claim: the job keeps none
    assert default.output is None
    moved = in_run_folder(default, folder)
    assert moved.trainer.checkpoint.path == str(tmp_path / "run" / "checkpoints")
    assert moved.trainer.checkpoint.every_steps == default.trainer.checkpoint.every_steps
    assert moved.output is not None
    # unset: the export chooses (fp32 for a merged LoRA adapter, else bf16)
    assert (moved.output.path, moved.output.dtype) == (str(tmp_path / "run" / "model"), None)

    spec = json.loads(handed_over_spec(tmp_path).read_text())
    spec["trainer"]["checkpoint"] = {"path": "/mine"}
    spec["output"] = {"path": "/served/policy", "dtype": "fp32"}
    named = in_run_folder(JobConfig.model_validate(spec), folder)
    assert named.trainer.checkpoint.path == "/mine"
    assert named.output == JobConfig.model_validate(spec).output
