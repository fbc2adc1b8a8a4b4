"""The trained policy as a Hugging Face directory: what `vllm serve DIR` and
`AutoModelForCausalLM.from_pretrained(DIR)` load.

`export_checkpoint` converts a committed checkpoint's actor (torch.distributed.checkpoint
shards, written by any number of ranks) into safetensors weights, config.json,
generation_config.json and the tokenizer (with its chat template where the model has
one), in bf16 or fp32. It reads the shards in this one process, with no process group,
no Ray and no GPU: on a laptop or in a pod.

The architecture and the tokenizer come from the job's actor model (`models.actor`): a
tiny model's are built from its config, a model's from its path. A checkpoint keeps the
job's config (`job.json`); one written before it was kept needs the job's spec given.

The directory is written like a checkpoint: into `.tmp-<name>` beside it, synced, then
renamed in place of the previous export, so a failure halfway leaves that one whole.

    python -m rlhf_trainer.export CHECKPOINT DIR [--dtype bf16|fp32] [--spec JOBCONFIG.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import Tensor
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.sections import ModelSource
from rlhf_trainer.models import COMPUTE_DTYPE, load_tokenizer, model_config
from rlhf_trainer.roles import checkpoint

DTYPES = tuple(COMPUTE_DTYPE)  # "fp32", "bf16"
DEFAULT_DTYPE = "bf16"
MODEL_KEY = "model."  # the role's state is {"model": …, "optimizer": …} (save_role_state)
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


def export_checkpoint(
    source: Path, target: Path, dtype: str = DEFAULT_DTYPE, config: JobConfig | None = None
) -> Export:
    """Write the actor of the committed checkpoint `source` as a Hugging Face directory
    at `target`, replacing a previous export there whole. `config`: the job's config,
    for a checkpoint that does not hold it."""
    if dtype not in COMPUTE_DTYPE:
        raise ExportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    step = committed_step(source)
    actor = actor_model(source, config)
    staging = start_export(target)  # an unwritable target fails before the long part
    try:
        weights = read_actor_weights(source / Role.ACTOR)
        model = policy_with_weights(actor, weights, source)
        write_hf_directory(model, actor, COMPUTE_DTYPE[dtype], staging)
        finish_export(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Export(target, step, dtype)


def committed_step(source: Path) -> int:
    """The step of a committed checkpoint; an error for anything else."""
    expected = "a committed checkpoint: a directory step-NNNNNNNN holding trainer_state.json"
    if not source.is_dir():
        raise ExportError(f"{source}: no such directory; expected {expected}")
    try:
        step = checkpoint.step_of(source)
    except ValueError:
        raise ExportError(f"{source}: not {expected}") from None
    if not (source / checkpoint.TRAINER_STATE_FILE).is_file():
        raise ExportError(f"{source}: no {checkpoint.TRAINER_STATE_FILE}; expected {expected}")
    return step


def actor_model(source: Path, config: JobConfig | None) -> ModelSource:
    """The job's actor model: from the given config, else the one the checkpoint holds."""
    if config is None:
        try:
            config = checkpoint.load_job_config(source)
        except (OSError, ValidationError) as error:
            raise ExportError(
                f"{source / checkpoint.JOB_CONFIG_FILE}: unreadable: {error}"
            ) from None
    if config is None:
        raise ExportError(
            f"{source}: no {checkpoint.JOB_CONFIG_FILE} (written before checkpoints kept the "
            "job's config); give the job's spec (--spec) for its models.actor"
        )
    return config.models.actor


def read_actor_weights(directory: Path) -> dict[str, Tensor]:
    """The actor's whole weights by their model names, read from its DCP shards in this
    process: every shard, whichever rank wrote it, lands in one full tensor."""
    try:
        reader = FileSystemReader(directory)
        metadata = reader.read_metadata()
    except (OSError, ValueError, RuntimeError) as error:
        raise ExportError(
            f"{directory}: no actor state: expected the actor's torch.distributed.checkpoint "
            f"shards (a .metadata file and *.distcp) ({error})"
        ) from None
    weights = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if name.startswith(MODEL_KEY) and isinstance(entry, TensorStorageMetadata)
    }
    if not weights:
        raise ExportError(f"{directory}: the checkpoint holds no model weights ({MODEL_KEY}*)")
    with warnings.catch_warnings():
        # DCP warns that it reads in one process with no process group: the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(weights, storage_reader=reader, no_dist=True)
    return {name.removeprefix(MODEL_KEY): tensor for name, tensor in weights.items()}


def policy_with_weights(
    actor: ModelSource, weights: dict[str, Tensor], source: Path
) -> PreTrainedModel:
    """The actor's architecture holding `weights` (no memory spent on initial weights:
    it is built on the meta device and takes the tensors themselves)."""
    architecture = model_config(actor.tiny) if actor.tiny is not None else hf_config(actor)
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(architecture, dtype=torch.float32)
    tied = bool(architecture.tie_word_embeddings)
    if tied:
        check_tied(weights, model, source)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as error:
        raise ExportError(
            f"{source / Role.ACTOR}: the weights do not fit the actor's model "
            f"({type(model).__name__}): {error}"
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


def check_tied(weights: dict[str, Tensor], model: PreTrainedModel, source: Path) -> None:
    """With tied embeddings the LM head is the input embedding: the checkpoint holds it
    under both names, and they must agree (a trained head is never dropped silently)."""
    embedding = model.get_input_embeddings().weight
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is embedding]
    held = [name for name in names if name in weights]
    for name in held[1:]:
        if not torch.equal(weights[name], weights[held[0]]):
            raise ExportError(
                f"{source / Role.ACTOR}: the model ties {name} to {held[0]}, "
                "but the checkpoint holds different tensors for them"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_trainer.export", description=__doc__)
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    parser.add_argument("directory", type=Path, metavar="DIR")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    parser.add_argument(
        "--spec", type=Path, help="the job's JobConfig JSON, for a checkpoint without job.json"
    )
    args = parser.parse_args(argv)
    try:
        config = JobConfig.model_validate_json(args.spec.read_text()) if args.spec else None
    except (OSError, ValidationError) as error:
        print(f"{args.spec}: not a readable JobConfig: {error}", file=sys.stderr)
        return 2
    try:
        done = export_checkpoint(args.checkpoint, args.directory, args.dtype, config)
    except ExportError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{done.directory}: the policy of step {done.step} in {done.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
