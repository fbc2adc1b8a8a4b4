"""A `file:NAME.py:FUNCTION` reward: read from the directory the operator mounts the
ConfigMap at, or, in a local run, from beside the manifest; a missing file or function
fails with an error that names models.reward.function, the path and what was expected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import rlhf_trainer.__main__ as driver
from rlhf_operator.app import cli
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.names import REWARD_FILES_ENV, REWARD_FILES_MOUNT
from rlhf_trainer.api.reward import RewardSource
from rlhf_trainer.data.tasks import check_reward_arguments, reward_files, reward_function
from tests.unit.conftest import EXAMPLES, load

SCORE_PY = """
from dataclasses import dataclass


@dataclass
class Weights:  # a dataclass looks its module up in sys.modules while it is made
    exact: float = 1.0


def score(prompt, response, answer, **_):
    return Weights().exact if response.strip() == answer else 0.0

NOT_A_FUNCTION = 3
"""


def file_reward(function: str = "file:score.py:score") -> RewardSource:
    return RewardSource(function=function, config_map="my-reward")


def test_a_function_in_a_file_is_loaded_and_called(tmp_path: Path) -> None:
    (tmp_path / "score.py").write_text(SCORE_PY)
    score = reward_function(file_reward(), tmp_path)
    assert score is not None
    assert score("2+3=", " 5 ", answer="5") == 1.0
    assert score("2+3=", "6", answer="5") == 0.0
    check_reward_arguments(score, ["answer"], "data.train")  # the row's columns fit


def test_the_files_are_read_from_the_operators_mount_unless_the_variable_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REWARD_FILES_ENV, raising=False)
    assert reward_files() == Path(REWARD_FILES_MOUNT) == Path("/etc/rlhf-reward")
    monkeypatch.setenv(REWARD_FILES_ENV, str(tmp_path))
    (tmp_path / "score.py").write_text(SCORE_PY)
    score = reward_function(file_reward())
    assert score is not None and score("p", "x", answer="x") == 1.0


def test_a_missing_file_names_the_field_the_path_and_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        reward_function(file_reward(), tmp_path)
    assert str(caught.value) == (
        f"models.reward.function: 'file:score.py:score': no file {tmp_path}/score.py "
        "(expected score.py, a key of models.reward.configMap, mounted at "
        f"{tmp_path}; a local run reads it from the manifest's directory)"
    )


@pytest.mark.parametrize(
    ("function", "found"),
    [("file:score.py:scroe", "nothing"), ("file:score.py:NOT_A_FUNCTION", "a int"),
     ("file:score.py:Weights", "a type")],
)  # fmt: skip
def test_a_missing_function_names_the_field_the_path_and_what_is_there(
    tmp_path: Path, function: str, found: str
) -> None:
    (tmp_path / "score.py").write_text(SCORE_PY)
    name = function.rpartition(":")[2]
    with pytest.raises(ValueError) as caught:
        reward_function(file_reward(function), tmp_path)
    assert str(caught.value) == (
        f"models.reward.function: {function!r}: {tmp_path}/score.py has no function "
        f"{name!r} (found {found} by that name)"
    )


def test_a_file_that_fails_to_import_says_why(tmp_path: Path) -> None:
    (tmp_path / "score.py").write_text("def score(prompt, response):\n    return 1.0 +\n")
    with pytest.raises(ValueError, match=r"^models.reward.function: 'file:score.py:score': "
                       rf"cannot import {tmp_path}/score.py: SyntaxError: "):  # fmt: skip
        reward_function(file_reward(), tmp_path)


def local_manifest(directory: Path) -> Path:
    """The local example with a file: reward, written into `directory` beside score.py."""
    job: dict[str, Any] = load(EXAMPLES[0].parent / "local-cpu.yaml")
    job["spec"]["models"]["reward"] = {"function": "file:score.py:score", "configMap": "rw"}
    directory.mkdir()
    (directory / "score.py").write_text(SCORE_PY)
    manifest = directory / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    return manifest


def test_a_local_run_reads_the_file_from_the_manifests_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlhfjob train` hands the trainer the manifest's directory, and the driver loads
    the reward from there. The driver runs in this process and stops before Ray."""
    manifest = local_manifest(tmp_path / "team")
    handed: dict[str, Any] = {}

    def run_driver(command: list[str], env: object = None) -> int:  # python -m rlhf_trainer ARGS
        assert command[1:3] == ["-m", "rlhf_trainer"]
        return driver.main(command[3:])

    def train(config: JobConfig, job: str, **settings: Any) -> int:
        handed.update(
            settings, reward=reward_function(config.models.reward, settings["reward_files"])
        )
        return 0

    monkeypatch.setattr(cli, "run_in_foreground", run_driver)
    monkeypatch.setattr(driver, "train", train)
    monkeypatch.chdir(tmp_path)  # not the manifest's directory
    assert cli.main(["train", str(manifest)]) == 0
    assert handed["local"] and handed["reward_files"] == manifest.parent
    assert handed["reward"]("p", "a", answer="a") == 1.0


def test_the_driver_reads_a_local_spec_from_beside_it_and_a_clusters_from_the_mount(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "spec.json"
    assert driver.reward_files_for(spec, None, local=True) == tmp_path
    assert driver.reward_files_for(Path("spec.json"), None, local=True) == Path.cwd()
    assert driver.reward_files_for(spec, None, local=False) is None  # the mount
    assert driver.reward_files_for(spec, tmp_path / "r", local=False) == tmp_path / "r"
