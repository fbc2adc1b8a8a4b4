from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_operator.app.cli import main, run_in_foreground
from tests.unit.conftest import EXAMPLES, load


def test_valid_files_print_ok_and_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", *map(str, EXAMPLES)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{p}: ok" for p in EXAMPLES]


def test_errors_are_printed_with_file_and_field_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load(EXAMPLES[0].parent / "local-cpu.yaml")
    job["spec"]["roles"]["actor"] = "missing-pool"
    job["spec"]["pools"][1]["gpusPerNode"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    good = EXAMPLES[0]

    assert main(["validate", str(good), str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{good}: ok"
    assert (
        f"{bad}: spec.pools[1].gpusPerNode: Input should be greater than or equal to 1 (got 0)"
        in lines
    )


def test_multi_document_files_name_the_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load(EXAMPLES[0])
    broken = {**job, "spec": {**job["spec"], "suspend": "sometimes"}}
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([job, broken]))
    assert main(["validate", str(both)]) == 1
    assert capsys.readouterr().out.startswith(
        f"{both}[1]: spec.suspend: Input should be a valid boolean"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [("spec: [unclosed", "not valid YAML"), ("", "no YAML document found"),
     ("- a\n- b\n", "expected a mapping")],
)  # fmt: skip
def test_unreadable_input_is_an_error_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(content)
    assert main(["validate", str(path)]) == 1
    assert message in capsys.readouterr().out


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "/no/such/file.yaml"]) == 1
    assert "cannot read" in capsys.readouterr().out


def test_plan_prints_pools_roles_and_overlapping_phases(capsys: pytest.CaptureFixture[str]) -> None:
    path = EXAMPLES[0].parent / "fully-async.yaml"
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fully-async ({path})\nmode: async, 16 GPUs in 2 pool(s)\n")
    assert "background  rollout: generate  (overlaps every stage)" in out


def test_plan_of_an_invalid_file_shows_the_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: rlhf.dev/v1alpha1\nkind: RLHFJob\nmetadata: {name: x}\n")
    assert main(["plan", str(bad)]) == 1
    assert f"{bad}: spec: required field is missing" in capsys.readouterr().out


def test_render_prints_the_owned_objects_as_a_yaml_stream(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["render", str(EXAMPLES[0].parent / "colocated.yaml"), "--namespace", "ml"]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "colocated-spec"), ("ServiceAccount", "colocated-reporter"),
        ("Role", "colocated-reporter"), ("RoleBinding", "colocated-reporter"), ("RayJob", "colocated"),
    ]  # fmt: skip
    assert {o["metadata"]["namespace"] for o in objects} == {"ml"}


def test_validate_names_the_field_of_a_critic_free_mistake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load(EXAMPLES[0].parent / "grpo-split.yaml")
    job["spec"]["generation"]["samplesPerPrompt"] = 1
    bad = tmp_path / "grpo.yaml"
    bad.write_text(yaml.safe_dump(job))
    assert main(["validate", str(bad)]) == 1
    assert capsys.readouterr().out.startswith(
        f"{bad}: spec.generation.samplesPerPrompt: must be at least 2 for the estimators"
    )


def test_validate_warns_of_a_path_no_volume_mounts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load(EXAMPLES[0].parent / "split-8gpu-4-4.yaml")
    job["spec"]["models"]["reward"] = {"path": "/weights/rm"}
    job["spec"]["pods"]["volumes"] = [
        v for v in job["spec"]["pods"]["volumes"] if v["name"] != "data"
    ]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["validate", str(path)]) == 0  # a warning: the image may carry the files
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: ok",
        f"{path}: warning: spec.models.reward.path: /weights/rm is under no volume the pods mount (spec.pods.volumes)",
        f"{path}: warning: spec.data.train: /data/prompts/train.parquet is under no volume the pods mount (spec.pods.volumes)",
        f"{path}: warning: spec.data.eval: /data/prompts/eval.parquet is under no volume the pods mount (spec.pods.volumes)",
    ]


def test_train_waits_for_the_trainer_through_ctrl_c(default_sigint: None) -> None:
    # Ctrl-C goes to the whole process group: the child here sends it to its parent
    # and then finishes; the parent must outlive it and return its status.
    child = "import os, signal, sys, time; os.kill(os.getppid(), signal.SIGINT); time.sleep(0.5); sys.exit(3)"
    assert run_in_foreground([sys.executable, "-c", child]) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_train_reports_a_trainer_killed_by_a_signal_as_a_shell_does() -> None:
    child = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert run_in_foreground([sys.executable, "-c", child]) == 128 + signal.SIGTERM


def test_train_cpu_hides_every_device_and_steps_replaces_total_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`rlhfjob train --cpu --steps 3`: the trainer process is shown no CUDA device (an
    empty CUDA_VISIBLE_DEVICES, which the local cluster starts under) and trains 3 steps;
    without --cpu the environment is passed on as it is."""
    import json

    import rlhf_operator.app.cli as cli

    seen: list[tuple[dict[str, object], dict[str, str] | None]] = []

    def trainer(command: list[str], env: dict[str, str] | None = None) -> int:
        spec = json.loads(Path(command[command.index("--spec") + 1]).read_text())
        seen.append((spec["trainer"], env))
        return 0

    monkeypatch.setattr(cli, "run_in_foreground", trainer)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    example = str(EXAMPLES[0].parent / "local-cpu.yaml")
    assert main(["train", "--cpu", "--steps", "3", example]) == 0
    assert main(["train", example]) == 0
    (cpu_trainer, cpu_env), (trainer_spec, env) = seen
    assert cpu_trainer["totalSteps"] == 3 and cpu_env is not None
    assert cpu_env["CUDA_VISIBLE_DEVICES"] == ""
    assert trainer_spec["totalSteps"] == 200 and env is not None
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize("steps", ["0", "-2", "two"])
def test_train_refuses_steps_that_are_not_a_positive_count(
    steps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["train", "--steps", steps, str(EXAMPLES[0].parent / "local-cpu.yaml")])
    assert exited.value.code == 2
    assert "--steps: expected a whole number of 1 or more" in capsys.readouterr().err


def test_export_leaves_the_dtype_to_the_export_unless_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without --dtype the export picks (fp32 for a LoRA merged into its base: bf16
    would round its update away), so the CLI passes none; a given one is passed on."""
    import rlhf_operator.app.cli as cli

    commands: list[list[str]] = []
    monkeypatch.setattr(
        cli, "run_in_foreground", lambda command, env=None: commands.append(command) or 0
    )
    assert main(["export", str(tmp_path / "step-00000001"), str(tmp_path / "hf")]) == 0
    assert (
        main(["export", str(tmp_path / "step-00000001"), str(tmp_path / "hf"), "--dtype", "bf16"])
        == 0
    )
    assert "--dtype" not in commands[0]
    assert commands[1][-2:] == ["--dtype", "bf16"]
