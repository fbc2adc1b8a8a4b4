"""The driver entry point reads the spec the operator hands over, or says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_operator.validation import parse_job
from rlhf_trainer.__main__ import main
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
