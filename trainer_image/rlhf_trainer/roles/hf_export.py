"""The trained policy written as a Hugging Face directory, whole or not at all: what
`vllm serve DIR` and `AutoModelForCausalLM.from_pretrained(DIR)` load.

Two writers share it: the actor's rank 0 at the end of a job (and every
trainer.export.everySteps), from the weights its ranks gather (roles.policy), and
`python -m rlhf_trainer.export`, from a committed checkpoint's shards (export.py).

The directory is written like a checkpoint: into `.tmp-<name>` beside it, synced, then
renamed in place of the previous export, so a failure halfway leaves that one whole.
"""

from __future__ import annotations

import os
import shutil
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from torch import Tensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from rlhf_trainer.api.sections import ModelSource, TrainedModel
from rlhf_trainer.models import COMPUTE_DTYPE, load_tokenizer, model_config
from rlhf_trainer.roles import checkpoint
from rlhf_trainer.roles.lora import adapter_of, with_trained_adapter
from rlhf_trainer.roles.lora_merge import merged_policy
from rlhf_trainer.roles.trainable import load_policy

DTYPES = tuple(COMPUTE_DTYPE)  # "fp32", "bf16"
DEFAULT_DTYPE = "bf16"  # but fp32 for a merged LoRA adapter (see export_dtype)
STAGING_PREFIX = ".tmp-"  # + the export's name: being written
REPLACED_PREFIX = ".old-"  # + the export's name: the previous export, being replaced


class ExportError(Exception):
    """The export cannot be made: the message names the path and what was expected."""


@dataclass(frozen=True)
class Export:
    """A finished export: where it is, the step it holds and its dtype."""

    directory: Path
    step: int
    dtype: str
    adapter: bool = False  # the LoRA adapter alone (peft's format), not a whole model


def write_policy(
    weights: dict[str, Tensor],
    actor: TrainedModel,
    target: Path,
    dtype: str | None,
    step: int,
    origin: str,
    *,
    seed: int,
    adapter: bool = False,
    dtype_field: str = "output.dtype",
) -> Export:
    """Write `weights` (the whole actor, by their model names) as a Hugging Face
    directory at `target`, replacing a previous export there whole, in `dtype` (None:
    `export_dtype`'s default). `origin` names where the weights came from, in errors;
    `dtype_field` where the dtype was asked for, in the warning of a bf16 merge.

    With `actor.lora`, `weights` are the adapter's alone (what trains): the base is
    built again from the spec's model (a tiny one from `seed`) and the adapter merged
    into it in fp32 (roles.lora_merge), or, `adapter`, written alone in peft's format
    for `vllm serve BASE --enable-lora` (no base, no tokenizer: the base's are those)."""
    dtype = export_dtype(dtype, actor, adapter)
    if adapter and actor.lora is None:
        raise ExportError(f"{origin}: only a LoRA'd actor (models.actor.lora) has an adapter")
    staging = start_export(target)
    try:
        if actor.lora is None:
            write_hf_directory(
                policy_with_weights(actor, weights, origin), actor, COMPUTE_DTYPE[dtype], staging
            )
        else:
            lora_policy = adapted_policy(actor, weights, origin, seed, base=not adapter)
            if adapter:
                adapter_of(lora_policy, weights, COMPUTE_DTYPE[dtype]).write(staging)
            else:
                merged = merged_policy(lora_policy, COMPUTE_DTYPE[dtype], f"{dtype_field} {dtype}")
                write_hf_directory(merged, actor, COMPUTE_DTYPE[dtype], staging)
        finish_export(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Export(target, step, dtype, adapter)


def export_dtype(dtype: str | None, actor: TrainedModel, adapter: bool) -> str:
    """The dtype asked for, else the default: fp32 for a LoRA adapter merged into its
    base (in bf16, W + BA rounds back toward W and a small update is lost:
    roles.lora_merge), bf16 for anything else (a whole model that trained all its
    weights, an adapter written alone)."""
    if dtype is None:
        return "fp32" if actor.lora is not None and not adapter else DEFAULT_DTYPE
    if dtype not in COMPUTE_DTYPE:
        raise ExportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def adapted_policy(
    actor: TrainedModel, adapter: dict[str, Tensor], origin: str, seed: int, base: bool
) -> PeftModel:
    """The LoRA'd actor holding `adapter`, on the spec's base model (`base`), or on its
    architecture alone (the meta device: enough to write the adapter itself)."""
    assert actor.lora is not None
    if base:
        model = load_policy(actor, seed)
    else:
        with torch.device("meta"):
            model = load_policy(actor, seed, weights=False)
    try:
        return with_trained_adapter(model, actor.lora, adapter, origin)
    except ValueError as error:
        raise ExportError(str(error)) from None


def check_target(target: Path) -> None:
    """Fail now, naming the path and the error, if an export cannot be written at
    `target` (a job checks at its start, not at its end)."""
    shutil.rmtree(start_export(target))


def policy_with_weights(
    actor: ModelSource, weights: dict[str, Tensor], origin: str
) -> PreTrainedModel:
    """The actor's architecture holding `weights` (no memory spent on initial weights:
    it is built on the meta device and takes the tensors themselves)."""
    architecture = model_config(actor.tiny) if actor.tiny is not None else hf_config(actor)
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(architecture, dtype=torch.float32)
    tied = bool(architecture.tie_word_embeddings)
    if tied:
        check_tied(weights, model, origin)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as error:
        raise ExportError(
            f"{origin}: the weights do not fit the actor's model ({type(model).__name__}): {error}"
        ) from None
    if tied:
        model.tie_weights()  # assign=True gave the LM head a tensor of its own
    return model


def hf_config(actor: ModelSource) -> PretrainedConfig:
    assert actor.path is not None  # the spec's rules: exactly one of path or tiny
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(actor.path)
        return config
    except OSError as error:
        raise ExportError(
            f"models.actor.path {actor.path}: cannot read the model's config.json ({error}); "
            "the export reads the actor's config and tokenizer from there"
        ) from None


def check_tied(weights: dict[str, Tensor], model: PreTrainedModel, origin: str) -> None:
    """With tied embeddings the LM head is the input embedding: the weights may hold it
    under both names, and they must agree (a trained head is never dropped silently)."""
    embedding = model.get_input_embeddings().weight
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is embedding]
    held = [name for name in names if name in weights]
    for name in held[1:]:
        if not torch.equal(weights[name], weights[held[0]]):
            raise ExportError(
                f"{origin}: the model ties {name} to {held[0]}, "
                "but the weights hold different tensors for them"
            )


def write_hf_directory(
    model: PreTrainedModel, actor: ModelSource, dtype: torch.dtype, directory: Path
) -> None:
    """Weights (safetensors), config, generation config and tokenizer into `directory`."""
    if actor.path is not None:
        # Without one of its own, the model keeps the one derived from its config.
        with suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(actor.path)
    model.to(dtype).save_pretrained(directory)
    load_tokenizer(actor).save_pretrained(directory)


# The directory, replaced whole.


def start_export(target: Path) -> Path:
    """A fresh staging directory beside `target`; the error names the path when it
    cannot be written. A previous export left aside by a crash is put back first."""
    staging = target.parent / (STAGING_PREFIX + target.name)
    replaced = target.parent / (REPLACED_PREFIX + target.name)
    try:
        if replaced.is_dir() and not target.exists():
            os.rename(replaced, target)  # a crash between finish_export's two renames
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    except OSError as error:
        raise ExportError(f"{target}: cannot write the export here: {error}") from None
    if target.exists() and not target.is_dir():
        shutil.rmtree(staging, ignore_errors=True)
        raise ExportError(f"{target}: exists and is not a directory")
    return staging


def finish_export(staging: Path, target: Path) -> None:
    """Put the complete export at `target`: synced, then renamed in. A previous export
    is renamed aside first and removed after (rename cannot replace a non-empty
    directory); a crash between the two leaves it aside whole, and the next export
    puts it back. Every file is made readable by all (0644): transformers writes the
    weights through a private temporary file (0600), and a server running as another
    user (a vLLM pod reading the claim) must read them."""
    for path in staging.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    checkpoint.fsync_tree(staging)
    replaced = target.parent / (REPLACED_PREFIX + target.name)
    shutil.rmtree(replaced, ignore_errors=True)
    if target.exists():
        os.rename(target, replaced)
    os.rename(staging, target)
    checkpoint.fsync(target.parent)
    shutil.rmtree(replaced, ignore_errors=True)
