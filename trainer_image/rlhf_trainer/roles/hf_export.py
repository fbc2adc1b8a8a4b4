"""The trained policy written as a Hugging Face directory, whole or not at all: what
`vllm serve DIR` and `AutoModelForCausalLM.from_pretrained(DIR)` load.

Two writers share it: the actor's rank 0 at the end of a job (and every
trainer.export.everySteps), from the weights its ranks gather (roles.policy), and
`python -m rlhf_trainer.export`, from a committed checkpoint's shards (export.py).

The files beside the weights are built in roles.export_files, which the driver imports
to check them at a job's start (`check_export`) without this module's peft and models.

The directory is written like a checkpoint: into `.tmp-<name>` beside it, synced, then
renamed in place of the previous export, so a failure halfway leaves that one whole.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from peft import PeftModel
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM_NAMES,
)

from rlhf_trainer.api.sections import ModelSource, TrainedModel
from rlhf_trainer.models import (
    COMPUTE_DTYPE,
    TOKENIZER_SUBDIR,
    load_tokenizer,
    model_config,
    save_tokenizer,
    word_level,
)
from rlhf_trainer.roles.export_dir import MARKER as MARKER
from rlhf_trainer.roles.export_dir import REPLACED_PREFIX as REPLACED_PREFIX
from rlhf_trainer.roles.export_dir import STAGING_PREFIX as STAGING_PREFIX
from rlhf_trainer.roles.export_dir import Export as Export
from rlhf_trainer.roles.export_dir import ExportError as ExportError
from rlhf_trainer.roles.export_dir import (
    check_free_space,
    finish_export,
    start_export,
    write_marker,
)
from rlhf_trainer.roles.export_files import actor_generation_config, hf_config, saveable, where
from rlhf_trainer.roles.export_files import check_export as check_export
from rlhf_trainer.roles.hf_serve import SERVE_FILE, serve_command, serve_readme
from rlhf_trainer.roles.lora import adapter_of, with_trained_adapter
from rlhf_trainer.roles.lora_merge import (
    adapted_modules,
    base_weights,
    merged_policy,
    write_merged,
)
from rlhf_trainer.roles.trainable import load_policy

log = logging.getLogger(__name__)

DTYPES = tuple(COMPUTE_DTYPE)  # "fp32", "bf16"
DEFAULT_DTYPE = "bf16"  # but fp32 for a merged LoRA adapter (see export_dtype)


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
    for `vllm serve BASE --enable-lora` (no base, no tokenizer: the base's are those,
    but for a word-level one, in tokenizer/). A README.md holds the `vllm serve` command
    that serves it as trained (roles.hf_serve), which is also logged and returned."""
    dtype = export_dtype(dtype, actor, adapter)
    if adapter and actor.lora is None:
        raise ExportError(f"{origin}: only a LoRA'd actor (models.actor.lora) has an adapter")
    staging = start_export(target)
    try:
        words = write_model(weights, actor, target, dtype, origin, seed, adapter, dtype_field)
        command = serve_command(target, dtype, actor, adapter, words)
        readme = serve_readme(command, step, dtype, actor, adapter, seed)
        (staging / SERVE_FILE).write_text(readme)
        write_marker(staging, Export(target, step, dtype, adapter))
        finish_export(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("%s: the export of step %d; serve it with: %s", target, step, command)
    return Export(target, step, dtype, adapter, serve=command)


def write_model(
    weights: dict[str, Tensor],
    actor: TrainedModel,
    target: Path,
    dtype: str,
    origin: str,
    seed: int,
    adapter: bool,
    dtype_field: str,
) -> bool:
    """The export's files (write_policy) into its staging directory, once the volume is
    known to have room for them; whether its tokenizer is word-level (saved in
    tokenizer/ too, for vLLM: models.save_tokenizer)."""
    staging, size = target.parent / (STAGING_PREFIX + target.name), COMPUTE_DTYPE[dtype].itemsize
    if actor.lora is None:
        model = policy_with_weights(actor, weights, origin)
        check_free_space(staging, target, size * sum(p.numel() for p in model.parameters()))
        return write_hf_directory(model, actor, COMPUTE_DTYPE[dtype], staging)
    lora_policy = adapted_policy(actor, weights, origin, seed, base=False)  # meta base
    held = weights.values() if adapter else lora_policy.parameters()
    check_free_space(staging, target, size * sum(t.numel() for t in held))
    if adapter:
        adapter_of(lora_policy, weights, COMPUTE_DTYPE[dtype]).write(staging)
        tokenizer = load_tokenizer(actor)  # the base's serves it, but not a word-level one
        if word_level(tokenizer):
            tokenizer.save_pretrained(staging / TOKENIZER_SUBDIR)
        return word_level(tokenizer)
    asked = f"{dtype_field} {dtype}"
    base = base_weights(actor, seed, set(adapted_modules(lora_policy)))
    if base is None:  # the whole base in memory: see lora_merge.base_weights
        log.warning("%s: the merge loads the whole base model in fp32", where(actor))
        lora_policy = adapted_policy(actor, weights, origin, seed, base=True)
        merged = merged_policy(lora_policy, COMPUTE_DTYPE[dtype], asked)
        return write_hf_directory(merged, actor, COMPUTE_DTYPE[dtype], staging)
    write_merged(lora_policy, base, COMPUTE_DTYPE[dtype], staging, asked)
    return write_model_files(actor, COMPUTE_DTYPE[dtype], staging)


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
) -> bool:
    """Weights (safetensors), config, generation config and tokenizer into `directory`;
    whether the tokenizer is word-level (models.save_tokenizer)."""
    # Without one of its own, the model keeps the one derived from its config.
    found = actor_generation_config(actor)
    model.generation_config = saveable(found or model.generation_config, actor)
    model.to(dtype).save_pretrained(directory)
    return save_tokenizer(load_tokenizer(actor), directory) is not None


def write_model_files(actor: ModelSource, dtype: torch.dtype, directory: Path) -> bool:
    """The files beside weights written without a model (a streamed merge): config
    (naming the dtype and the architecture), generation config and tokenizer, as
    `write_hf_directory` writes them; whether the tokenizer is word-level."""
    architecture = model_config(actor.tiny) if actor.tiny is not None else hf_config(actor)
    architecture.dtype = dtype
    if not architecture.architectures:
        architecture.architectures = [CAUSAL_LM_NAMES[architecture.model_type]]
    architecture.save_pretrained(directory)
    found = actor_generation_config(actor)
    saveable(found or GenerationConfig.from_model_config(architecture), actor).save_pretrained(
        directory
    )
    return save_tokenizer(load_tokenizer(actor), directory) is not None
