"""The export of a checkpoint's policy as a Hugging Face directory, on checkpoints written
here in one process (no Ray): what it writes, that it replaces a previous export whole
or not at all, and the errors for a target it cannot write and for bad checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from rlhf_operator.app import cli
from rlhf_trainer import export
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import ModelSource
from rlhf_trainer.export import ExportError, export_checkpoint
from rlhf_trainer.models import build_tiny_model, build_tokenizer, load_tokenizer
from rlhf_trainer.roles import checkpoint, hf_export
from rlhf_trainer.roles.trainable import load_policy
from tests.conftest import skip_or_fail
from tests.exports import tree_bytes
from tests.specs import local_job

WEIGHTS = "model.safetensors"


@pytest.fixture
def config(tmp_path: Path) -> JobConfig:
    return local_job(
        colocated=True, total_steps=2, checkpoint_dir=tmp_path / "checkpoints", every_steps=1
    )


def write_checkpoint(
    root: Path, step: int, model: PreTrainedModel, config: JobConfig | None
) -> Path:
    """A committed checkpoint as a run writes it: the actor's DCP state (here from one
    process), the driver's state and, unless None, the job's config."""
    staging = checkpoint.staging_dir(root, step)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp_save({"model": model.state_dict()}, checkpoint_id=staging / "actor", no_dist=True)
    state = checkpoint.TrainerState(step, step, 0, 0, checkpoint.capture_rng())
    checkpoint.save_trainer_state(staging, state)
    if config is not None:
        checkpoint.save_job_config(staging, config)
    return checkpoint.commit(root, step)


def trained_policy(config: JobConfig, seed: int) -> PreTrainedModel:
    """The actor's model with weights of its own (the seed stands in for training)."""
    assert config.models.actor.tiny is not None
    return build_tiny_model(config.models.actor.tiny, seed=seed)


@pytest.fixture
def saved(tmp_path: Path, config: JobConfig) -> tuple[Path, PreTrainedModel]:
    policy = trained_policy(config, seed=1)
    return write_checkpoint(tmp_path / "checkpoints", 1, policy, config), policy


def test_the_export_holds_the_checkpoints_weights_tied_as_from_pretrained_expects(
    saved: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    source, policy = saved
    done = export_checkpoint(source, tmp_path / "hf", dtype="fp32")
    assert (done.directory, done.step, done.dtype) == (tmp_path / "hf", 1, "fp32")
    written = {p.name for p in done.directory.iterdir()}
    assert {WEIGHTS, "config.json", "generation_config.json", "tokenizer.json"} <= written
    # readable by a server running as another user (transformers writes the weights 0600)
    files = [p for p in done.directory.rglob("*") if p.is_file()]
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o644"}
    with safe_open(done.directory / WEIGHTS, "pt") as weights:
        # Tied: the LM head is the embedding, stored once, as save_pretrained does.
        assert "lm_head.weight" not in weights.keys()  # noqa: SIM118 (safe_open has no __contains__)
    loaded = AutoModelForCausalLM.from_pretrained(done.directory, dtype=torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    expected = policy.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    tokenizer = AutoTokenizer.from_pretrained(done.directory)
    assert tokenizer("c a f e =").input_ids == build_tokenizer(64)("c a f e =").input_ids
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))


def test_an_exported_tiny_policy_loads_back_as_a_models_path_with_its_tokenizer(
    saved: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    """A job continuing from it (models.actor.path) decodes as the tiny model did: the
    toy rewards read space-separated letters."""
    source, policy = saved
    done = export_checkpoint(source, tmp_path / "hf", dtype="fp32")
    base = ModelSource(path=str(done.directory))
    tokenizer, tiny = load_tokenizer(base), build_tokenizer(64)
    ids = [*tiny("c a f e =").input_ids, tiny.eos_token_id]
    assert tokenizer("c a f e =").input_ids == ids[:-1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "c a f e ="
    assert tokenizer.decode(ids) == tiny.decode(ids)
    assert (tokenizer.padding_side, tokenizer.pad_token_id) == ("left", tiny.pad_token_id)
    loaded = load_policy(base, seed=0).state_dict()
    assert all(torch.equal(t, loaded[name]) for name, t in policy.state_dict().items())


def test_bf16_is_the_default_and_every_tensor_is_bf16(
    saved: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    source, _ = saved
    done = export_checkpoint(source, tmp_path / "hf")
    assert done.dtype == "bf16"
    with safe_open(done.directory / WEIGHTS, "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert AutoModelForCausalLM.from_pretrained(done.directory).dtype == torch.bfloat16


def test_an_export_that_fails_halfway_leaves_the_previous_one_whole(
    saved: tuple[Path, PreTrainedModel],
    tmp_path: Path,
    config: JobConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source, _ = saved
    target = tmp_path / "hf"
    export_checkpoint(source, target, dtype="fp32")
    previous = tree_bytes(target)
    newer = write_checkpoint(source.parent, 2, trained_policy(config, seed=2), config)

    class FailingTokenizer:
        """Fails as the tokenizer is written: after the new weights are."""

        def save_pretrained(self, directory: Path, **_: Any) -> None:
            assert (Path(directory) / WEIGHTS).is_file()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "load_tokenizer", lambda _: FailingTokenizer())
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(newer, target, dtype="fp32")
    assert tree_bytes(target) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf"]

    monkeypatch.undo()  # the next export replaces it whole
    export_checkpoint(newer, target, dtype="fp32")
    assert (target / WEIGHTS).read_bytes() != previous[WEIGHTS]


def test_an_unwritable_target_fails_first_naming_the_path(
    saved: tuple[Path, PreTrainedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, _ = saved
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "hf"

    def not_reached(*_: Any) -> None:
        raise AssertionError("the weights were read before the target was checked")

    monkeypatch.setattr(export, "read_actor_weights", not_reached)
    with pytest.raises(ExportError, match=rf"{target}: cannot write the export here: .*Not a dir"):
        export_checkpoint(source, target)


def test_bad_checkpoints_are_refused_naming_the_path_and_what_was_expected(
    saved: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    source, _ = saved
    target = tmp_path / "hf"
    root = source.parent
    with pytest.raises(ExportError, match=rf"{root}: not a committed checkpoint"):
        export_checkpoint(root, target)
    with pytest.raises(ExportError, match=rf"{root / 'step-00000009'}: no such directory"):
        export_checkpoint(root / "step-00000009", target)
    (root / "step-00000005").mkdir()
    with pytest.raises(ExportError, match=r"no trainer_state\.json; expected a committed"):
        export_checkpoint(root / "step-00000005", target)
    (source / "actor" / ".metadata").unlink()
    with pytest.raises(ExportError, match=rf"{source / 'actor'}: no actor state"):
        export_checkpoint(source, target)
    assert not target.exists()


def test_a_checkpoint_without_the_jobs_config_needs_it_given(
    tmp_path: Path, config: JobConfig
) -> None:
    source = write_checkpoint(tmp_path / "checkpoints", 3, trained_policy(config, 1), None)
    with pytest.raises(ExportError, match=r"no job.json .* give the job's spec \(--spec\)"):
        export_checkpoint(source, tmp_path / "hf")
    assert export_checkpoint(source, tmp_path / "hf", config=config).step == 3


def test_a_tied_head_that_differs_from_the_embedding_is_refused(
    tmp_path: Path, config: JobConfig
) -> None:
    policy = trained_policy(config, seed=1)
    policy.lm_head.weight = torch.nn.Parameter(policy.lm_head.weight.detach() + 1)  # untied
    source = write_checkpoint(tmp_path / "checkpoints", 1, policy, config)
    with pytest.raises(ExportError, match=r"ties lm_head\.weight to model\.embed_tokens\.weight"):
        export_checkpoint(source, tmp_path / "hf")


def test_rlhfjob_export_writes_the_directory_and_reports_bad_input(
    saved: tuple[Path, PreTrainedModel], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    source, _ = saved
    assert cli.main(["export", str(source), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert "the policy of step 1 in fp32" in capfd.readouterr().out
    assert (tmp_path / "hf" / WEIGHTS).is_file()
    assert cli.main(["export", str(source.parent), str(tmp_path / "hf")]) == 1
    assert f"{source.parent}: not a committed checkpoint" in capfd.readouterr().err


def test_the_policy_is_written_at_the_end_and_every_export_every_steps_when_there_is_output(
    tmp_path: Path,
) -> None:
    from rlhf_trainer.loop.run import export_due

    spec = local_job(colocated=True, total_steps=50, checkpoint_dir=tmp_path, every_steps=10)
    wire = spec.to_dict()
    assert not any(export_due(spec, step) for step in range(51))  # no output: none
    wire["output"] = {"path": str(tmp_path / "model")}
    at_the_end = JobConfig.model_validate(wire)
    assert [s for s in range(51) if export_due(at_the_end, s)] == [50]
    wire["trainer"]["export"] = {"everySteps": 20}
    every_20 = JobConfig.model_validate(wire)
    assert [s for s in range(51) if export_due(every_20, s)] == [20, 40, 50]


def test_a_job_whose_output_cannot_be_written_fails_at_its_start_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked before any role starts (Ray is asked nothing), not at the job's end."""
    from rlhf_trainer.loop import run, setup
    from rlhf_trainer.telemetry.report import ConsoleReporter

    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "model"
    wire = local_job(colocated=True, total_steps=4, checkpoint_dir=tmp_path, every_steps=2)
    config = JobConfig.model_validate(wire.to_dict() | {"output": {"path": str(target)}})

    def not_reached(*_: Any) -> None:
        raise AssertionError("a role was started before the output was checked")

    monkeypatch.setattr(setup, "sample_queue", not_reached)
    monkeypatch.setattr(setup.RoleGroups, "start", not_reached)
    unwritable = rf"{target}: cannot write the export here: .*Not a dir"
    with (
        pytest.raises(ExportError, match=unwritable),
        run.open_run(config, "job", ConsoleReporter()),
    ):
        pass


def test_a_real_models_export_keeps_its_chat_template_generation_config_and_tokenizer(
    tmp_path: Path,
) -> None:
    """SmolLM2 (a model given by path, as users give theirs): what a server needs beside
    the weights comes from the actor's own directory. The tiny models have no template."""
    from tests.real_model import real_model_dir

    made = real_model_dir()
    if not (made / WEIGHTS).exists():
        skip_or_fail(f"no SmolLM2 at {made} (make real-model)")
    # Ours is converted from a GGUF, so its generation config only repeats its config's
    # token ids; the hub's holds sampling defaults, which an export must keep.
    source, exported = tmp_path / "SmolLM2", tmp_path / "export"
    source.mkdir()
    for file in made.iterdir():
        (source / file.name).symlink_to(file)
    (source / "generation_config.json").unlink()
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.2,
                     top_p=0.9).save_pretrained(source)  # fmt: skip
    actor = ModelSource(path=str(source))
    # Built as an export builds it: from the config, holding the checkpoint's weights.
    weights = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    model = hf_export.policy_with_weights(actor, weights, "SmolLM2's weights")
    hf_export.write_hf_directory(model, actor, torch.bfloat16, exported)
    written = AutoTokenizer.from_pretrained(exported)
    original = AutoTokenizer.from_pretrained(source)
    assert written.chat_template and written.chat_template == original.chat_template
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert written.apply_chat_template(chat, add_generation_prompt=True) == (
        original.apply_chat_template(chat, add_generation_prompt=True)
    )
    generation = GenerationConfig.from_pretrained(exported)
    assert (generation.do_sample, generation.temperature, generation.top_p) == (True, 0.2, 0.9)
    with safe_open(str(exported / WEIGHTS), "pt") as stored:
        assert {stored.get_slice(k).get_dtype() for k in stored.keys()} == {"BF16"}  # noqa: SIM118
