"""A LoRA adapter merged into its base for an export (roles.lora_merge): the merge in
fp32 and an fp32 export by default keep a small update (|BA| ~ 1e-3 |W|, the early
training of every LoRA run); one asked in bf16 loses most of it, measured and said.
One process, a tiny model, no Ray: ~5 s."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlhf_trainer.api.lora import LoraConfig
from rlhf_trainer.api.sections import TrainedModel
from rlhf_trainer.models import write_tiny_model
from rlhf_trainer.roles import lora_merge
from rlhf_trainer.roles.hf_export import Export, adapted_policy, write_policy
from rlhf_trainer.roles.lora import with_adapter
from rlhf_trainer.roles.lora_merge import merged_policy, update_lost
from rlhf_trainer.roles.trainable import load_policy
from tests.specs import local_job

SEED = 7
TARGETS = ["q_proj", "v_proj"]
Weights = dict[str, torch.Tensor]


@pytest.fixture
def actor() -> TrainedModel:
    """The local example's tiny actor, LoRA'd."""
    job = local_job(colocated=True, total_steps=1, checkpoint_dir=Path("/unused"), every_steps=1)
    lora = LoraConfig(rank=4, alpha=8, target_modules=TARGETS)
    return job.models.actor.model_copy(update={"lora": lora})


def adapter_of_size(actor: TrainedModel, relative: float) -> tuple[Weights, Weights]:
    """An adapter (its tensors by their names in the LoRA'd model, as a checkpoint holds
    them) whose update |BA| is `relative` of |W| on every adapted weight, and the base
    weights plus that update in fp32, by the merged model's names."""
    assert actor.lora is not None
    model = with_adapter(load_policy(actor, SEED), actor.lora)
    generator = torch.Generator().manual_seed(0)
    expected: Weights = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "lora_B"):
                continue
            module.lora_B["default"].weight.normal_(generator=generator)
            weight = module.get_base_layer().weight
            delta = module.get_delta_weight("default")
            module.lora_B["default"].weight.mul_(relative * weight.norm() / delta.norm())
            merged_name = name.removeprefix("base_model.model.") + ".weight"
            expected[merged_name] = weight + module.get_delta_weight("default")
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trained, expected


def merged_export(
    actor: TrainedModel, trained: dict[str, torch.Tensor], target: Path, dtype: str | None
) -> tuple[Export, dict[str, torch.Tensor]]:
    done = write_policy(trained, actor, target, dtype, 1, "test", seed=SEED)
    served = AutoModelForCausalLM.from_pretrained(target, dtype="auto").state_dict()
    return done, served


def lost(served: Weights, expected: Weights, base: Weights) -> float:
    """‖served update - update‖ / ‖update‖ over the adapted weights, as `update_lost`."""
    error = update = 0.0
    for name, want in expected.items():
        delta = want - base[name]
        got = served[name].float() - base[name].to(served[name].dtype).float()
        error += float((got - delta).square().sum())
        update += float(delta.square().sum())
    return (error / update) ** 0.5


def test_a_merged_export_is_fp32_by_default_and_keeps_a_small_update(
    actor: TrainedModel, tmp_path: Path
) -> None:
    trained, expected = adapter_of_size(actor, 1e-3)
    done, served = merged_export(actor, trained, tmp_path / "merged", dtype=None)
    assert done.dtype == "fp32"
    assert {t.dtype for t in served.values()} == {torch.float32}
    base = load_policy(actor, SEED).state_dict()
    assert lost(served, expected, base) < 1e-3  # fp32 rounding of W + BA only
    for name, want in expected.items():
        torch.testing.assert_close(served[name], want, rtol=0, atol=1e-7)


def test_a_merged_export_asked_in_bf16_says_how_much_of_the_update_it_lost(
    actor: TrainedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trained, expected = adapter_of_size(actor, 1e-3)
    with caplog.at_level(logging.WARNING, logger="rlhf_trainer.roles.lora_merge"):
        done, served = merged_export(actor, trained, tmp_path / "merged", dtype="bf16")
    assert done.dtype == "bf16"
    base = load_policy(actor, SEED).state_dict()
    measured = lost(served, expected, base)
    assert measured > 0.5  # most of the update is gone: what the warning is for
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"output.dtype bf16 loses {100 * measured:.0f}% of the LoRA update")
    assert "fp32 keeps it" in warning


def test_a_large_update_survives_bf16_without_a_warning(
    actor: TrainedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trained, _ = adapter_of_size(actor, 1.0)
    with caplog.at_level(logging.WARNING, logger="rlhf_trainer.roles.lora_merge"):
        merged_export(actor, trained, tmp_path / "merged", dtype="bf16")
    assert caplog.records == []


def test_the_update_lost_is_measured_per_dtype(actor: TrainedModel) -> None:
    assert actor.lora is not None
    model = with_adapter(load_policy(actor, SEED), actor.lora)
    assert update_lost(model, torch.bfloat16) == 0.0  # a fresh adapter (B = 0) changes nothing
    trained, _ = adapter_of_size(actor, 1e-2)
    model.load_state_dict(trained, strict=False)
    assert update_lost(model, torch.float32) < 1e-4
    assert 0.05 < update_lost(model, torch.bfloat16) < 0.6  # the issue measured 23% at 1e-2


def test_an_adapter_written_alone_keeps_bf16_as_its_default(
    actor: TrainedModel, tmp_path: Path
) -> None:
    trained, _ = adapter_of_size(actor, 1e-3)
    done = write_policy(
        trained, actor, tmp_path / "adapter", None, 1, "test", seed=SEED, adapter=True
    )
    assert (done.dtype, done.adapter) == ("bf16", True)


def test_the_merge_streams_a_path_models_files_in_shards_and_never_loads_the_base(
    actor: TrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base given by its path is read one tensor at a time from its safetensors files
    (transformers never loads it: the memory is a shard and a weight, not the model),
    written in shards of at most SHARD_BYTES with transformers' index, and the export
    is the merge made in memory, bit for bit."""
    trained, _ = adapter_of_size(actor, 1e-3)
    assert actor.tiny is not None
    base = write_tiny_model(actor.tiny, tmp_path / "base", seed=SEED)
    on_disk = actor.model_copy(update={"tiny": None, "path": str(base)})

    def no_whole_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the merge loaded the whole base model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_whole_model)
    monkeypatch.setattr(lora_merge, "SHARD_BYTES", 200_000)  # the tiny model: ~3 shards
    done = write_policy(trained, on_disk, tmp_path / "streamed", None, 1, "test", seed=SEED)
    monkeypatch.undo()
    shards = sorted(p.name for p in done.directory.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((done.directory / lora_merge.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert_same_weights(done.directory, adapted_policy(actor, trained, "test", SEED, base=True))
    config = json.loads((done.directory / "config.json").read_text())
    assert (config["dtype"], config["architectures"]) == ("float32", ["Qwen2ForCausalLM"])
    # That export, sharded, as a base: its files are the ones its index names.
    again = on_disk.model_copy(update={"path": str(done.directory)})
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_whole_model)
    twice = write_policy(trained, again, tmp_path / "twice", None, 1, "test", seed=SEED)
    monkeypatch.undo()
    assert_same_weights(twice.directory, adapted_policy(again, trained, "test", SEED, base=True))


def assert_same_weights(directory: Path, model: PeftModel) -> None:
    """The export at `directory` holds `model` merged in memory, bit for bit."""
    served = AutoModelForCausalLM.from_pretrained(directory, dtype="auto").state_dict()
    merged = merged_policy(model, torch.float32, "output.dtype fp32").state_dict()
    assert served.keys() == merged.keys()
    for name, weight in merged.items():
        assert torch.equal(served[name], weight), name


def test_a_base_it_cannot_stream_is_merged_whole_with_a_warning(
    actor: TrainedModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    trained, _ = adapter_of_size(actor, 1e-3)
    assert actor.tiny is not None
    base = write_tiny_model(actor.tiny, tmp_path / "base", seed=SEED)
    on_disk = actor.model_copy(update={"tiny": None, "path": str(base)})
    monkeypatch.setattr(lora_merge, "weight_files", lambda _: [])  # as for .bin weights
    with caplog.at_level(logging.WARNING, logger="rlhf_trainer.roles.hf_export"):
        done = write_policy(trained, on_disk, tmp_path / "whole", None, 1, "test", seed=SEED)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == f"models.actor.path {base}: the merge loads the whole base model in fp32"
    assert_same_weights(done.directory, adapted_policy(on_disk, trained, "test", SEED, base=True))
