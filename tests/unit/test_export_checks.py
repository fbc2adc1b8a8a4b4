"""What the export checks before it writes, and what it replaces (roles.hf_export):

- at a job's start (`check_export`), the files beside the weights are built and saved
  in a scratch directory beside the target, so a base model whose files transformers
  refuses to save fails then, naming the file and the reason, not after the training;
  sampling flags without do_sample (Llama-2-era generation configs) are repaired, and
  the export says so;
- output.path against what the job keeps and reads, as the file system resolves it
  (a symbolic link to the model is still the model);
- only a directory that carries the export marker (or an empty one) is replaced, and a
  crash between the two renames that replace it leaves the previous export whole.

One process, a tiny model saved as a path model, no Ray: ~10 s.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM, GenerationConfig

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import write_tiny_model
from rlhf_trainer.roles import export_files, hf_export
from rlhf_trainer.roles.hf_export import MARKER, ExportError, check_export, check_target
from tests.exports import tree_bytes
from tests.specs import local_job

LLAMA_2_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                      "temperature": 0.6, "top_p": 0.9, "max_length": 4096}  # fmt: skip


def path_job(tmp_path: Path, generation: dict[str, Any] | None, **output: Any) -> JobConfig:
    """The local example with its tiny actor saved as a model directory (a path model,
    as users give theirs), with `generation` as its generation_config.json, and output."""
    wire = local_job(colocated=True, total_steps=1, checkpoint_dir=tmp_path / "ckpt",
                     every_steps=1).to_dict()  # fmt: skip
    tiny = JobConfig.model_validate(wire).models.actor.tiny
    assert tiny is not None
    model = write_tiny_model(tiny, tmp_path / "models" / "base")
    if generation is not None:
        (model / "generation_config.json").write_text(json.dumps(generation))
    wire["models"]["actor"] = {"path": str(model)}
    wire["output"] = {"path": str(tmp_path / "out" / "policy")} | output
    return JobConfig.model_validate(wire)


def test_sampling_flags_without_do_sample_are_repaired_at_start_and_in_the_export(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = path_job(tmp_path, LLAMA_2_GENERATION)
    target = Path(config.output.path) if config.output else Path()
    with caplog.at_level(logging.WARNING, logger="rlhf_trainer.roles.export_files"):
        check_export(config)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == export_files.log.name]
    assert warning == (
        f"models.actor.path {config.models.actor.path}'s generation_config.json sets "
        "temperature, top_p without do_sample, which transformers refuses to save: the "
        "export sets do_sample: true (sampling with them, as vLLM does)"
    )
    assert sorted(p.name for p in target.parent.iterdir()) == []  # the scratch is gone
    # The export at the end writes it repaired, the flags kept.
    actor = config.models.actor
    model = AutoModelForCausalLM.from_pretrained(actor.path)
    hf_export.write_hf_directory(model, actor, model.dtype, tmp_path / "written")
    written = GenerationConfig.from_pretrained(tmp_path / "written")
    assert (written.do_sample, written.temperature, written.top_p) == (True, 0.6, 0.9)


def test_transformers_refuses_to_save_the_original_so_the_repair_is_needed(
    tmp_path: Path,
) -> None:
    """Why the start check matters: saved as it is, the file fails (what every export
    at a job's end did before)."""
    config = path_job(tmp_path, LLAMA_2_GENERATION)
    assert config.models.actor.path is not None
    as_found = GenerationConfig.from_pretrained(config.models.actor.path)
    with pytest.raises(ValueError, match="`do_sample` is not set to `True`"):
        as_found.save_pretrained(tmp_path / "as-found")


@pytest.mark.parametrize(
    ("generation", "words"),
    [
        ({"num_beams": 1, "early_stopping": True}, "generation_config.json: transformers "
         "refuses to save it: GenerationConfig is invalid: \n- `early_stopping`"),
        ({"num_return_sequences": 2}, "generation_config.json: transformers refuses to load it"),
    ],
    ids=["beam-flags-without-beams", "unloadable"],
)  # fmt: skip
def test_a_generation_config_that_cannot_be_repaired_fails_at_start_naming_the_file(
    tmp_path: Path, generation: dict[str, Any], words: str
) -> None:
    config = path_job(tmp_path, generation)
    target = tmp_path / "out" / "policy"
    with pytest.raises(ExportError) as raised:
        check_export(config)
    message = str(raised.value)
    assert message.startswith(f"{target}: the export would fail at the job's end: ")
    assert f"models.actor.path {config.models.actor.path}'s {words}" in message
    assert list(target.parent.iterdir()) == []


def test_a_model_whose_files_save_passes_and_leaves_nothing(tmp_path: Path) -> None:
    config = path_job(tmp_path, None)
    check_export(config)
    assert list((tmp_path / "out").iterdir()) == []


def test_an_output_reaching_the_model_through_a_link_fails_at_start(tmp_path: Path) -> None:
    """Admission compares the paths as written; the start, as they resolve."""
    config = path_job(tmp_path, None)
    (tmp_path / "alias").symlink_to(tmp_path / "models")
    wire = config.to_dict() | {"output": {"path": str(tmp_path / "alias" / "base" / "out")}}
    linked = JobConfig.model_validate(wire)
    with pytest.raises(ExportError, match=r"lies inside models\.actor\.path .*symbolic links"):
        check_export(linked)


def test_an_output_holding_the_checkpoints_fails_at_start(tmp_path: Path) -> None:
    config = path_job(tmp_path, None)
    wire = config.to_dict() | {"output": {"path": str(tmp_path)}}
    with pytest.raises(ExportError, match=r"holds the checkpoint root trainer\.checkpoint\.path"):
        check_export(JobConfig.model_validate(wire))


# The directory an export replaces.


def test_only_an_export_or_an_empty_directory_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "policy"
    target.mkdir()
    check_target(target)  # empty: fine
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ExportError) as raised:
        check_target(target)
    assert str(raised.value).startswith(
        f"{target}: holds files and is not an export of this project (no {MARKER} in it)"
    )
    assert (target / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    (target / MARKER).write_text("{}")
    check_target(target)


def test_every_export_carries_the_marker(tmp_path: Path) -> None:
    config = path_job(tmp_path, None)
    actor = config.models.actor
    model = AutoModelForCausalLM.from_pretrained(actor.path)
    weights = model.state_dict()
    done = hf_export.write_policy(weights, actor, tmp_path / "policy", None, 3, "test", seed=0)
    marker = json.loads((done.directory / MARKER).read_text())
    assert marker == {"writer": "rlhf-operator", "step": 3, "dtype": "bf16", "adapter": False}
    assert oct((done.directory / MARKER).stat().st_mode & 0o777) == "0o644"


def test_a_crash_between_the_two_renames_leaves_the_previous_export_to_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = path_job(tmp_path, None)
    actor = config.models.actor
    weights = AutoModelForCausalLM.from_pretrained(actor.path).state_dict()
    target = tmp_path / "policy"
    hf_export.write_policy(weights, actor, target, "fp32", 1, "test", seed=0)
    previous = tree_bytes(target)
    rename = os.rename

    def crash_on_the_second(source: Any, destination: Any) -> None:
        if Path(source).name.startswith(hf_export.STAGING_PREFIX):
            raise OSError("killed")  # the previous export is aside, the new one not in
        rename(source, destination)

    monkeypatch.setattr(os, "rename", crash_on_the_second)
    with pytest.raises(OSError, match="killed"):
        hf_export.write_policy(weights, actor, target, "fp32", 2, "test", seed=0)
    monkeypatch.undo()
    assert not target.exists()
    aside = tmp_path / (hf_export.REPLACED_PREFIX + target.name)
    assert tree_bytes(aside) == previous
    check_target(target)  # what the next job's start (or export) does first
    assert tree_bytes(target) == previous
    assert json.loads((target / MARKER).read_text())["step"] == 1
