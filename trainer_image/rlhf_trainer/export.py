"""The trained policy as a Hugging Face directory: what `vllm serve DIR` and
`AutoModelForCausalLM.from_pretrained(DIR)` load.

`export_checkpoint` converts a committed checkpoint's actor (torch.distributed.checkpoint
shards, written by any number of ranks) into safetensors weights, config.json,
generation_config.json and the tokenizer (with its chat template where the model has
one), in bf16 or fp32 (the default: fp32 for a LoRA adapter merged into its base, bf16
otherwise). It reads the shards in this one process, with no process group,
no Ray and no GPU: on a laptop or in a pod.

The architecture and the tokenizer come from the job's actor model (`models.actor`): a
tiny model's are built from its config, a model's from its path. A checkpoint keeps the
job's config (`job.json`); one written before it was kept needs the job's spec given.

The directory is written as a job writes its output (roles.hf_export): beside the
previous export, then renamed in place of it whole.

A LoRA'd actor's checkpoint holds its adapter: it is merged into the base model the
spec names, or written alone in peft's format (--adapter).

    python -m rlhf_trainer.export CHECKPOINT DIR [--dtype bf16|fp32] [--adapter]
                                  [--spec JOBCONFIG.json]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import Tensor
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.roles import checkpoint
from rlhf_trainer.roles.hf_export import (
    DEFAULT_DTYPE,
    DTYPES,
    Export,
    ExportError,
    check_target,
    export_dtype,
    write_policy,
)

MODEL_KEY = "model."  # the role's state is {"model": …, "optimizer": …} (save_role_state)


def export_checkpoint(
    source: Path,
    target: Path,
    dtype: str | None = None,
    config: JobConfig | None = None,
    adapter: bool = False,
) -> Export:
    """Write the actor of the committed checkpoint `source` as a Hugging Face directory
    at `target`, replacing a previous export there whole. `config`: the job's config,
    for a checkpoint that does not hold it. A LoRA'd actor's checkpoint holds its
    adapter: merged into the base the spec names, or (`adapter`) written alone. `dtype`
    None: fp32 for a merged adapter, else bf16 (`hf_export.export_dtype`)."""
    step = committed_step(source)
    job = job_config(source, config)
    actor, seed = job.models.actor, job.trainer.seed
    dtype = export_dtype(dtype, actor, adapter)
    check_target(target)  # an unwritable target fails before the long part
    weights = read_actor_weights(source / Role.ACTOR)
    origin = str(source / Role.ACTOR)
    return write_policy(
        weights, actor, target, dtype, step, origin, seed=seed, adapter=adapter,
        dtype_field="--dtype",
    )  # fmt: skip


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


def job_config(source: Path, config: JobConfig | None) -> JobConfig:
    """The job's config: the given one, else the one the checkpoint holds."""
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
    return config


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_trainer.export", description=__doc__)
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    parser.add_argument("directory", type=Path, metavar="DIR")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help=f"default: fp32 for a LoRA adapter merged into its base, else {DEFAULT_DTYPE}",
    )
    parser.add_argument(
        "--adapter", action="store_true", help="a LoRA'd actor's adapter alone, not merged"
    )
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
        done = export_checkpoint(args.checkpoint, args.directory, args.dtype, config, args.adapter)
    except ExportError as error:
        print(error, file=sys.stderr)
        return 1
    what = "the LoRA adapter" if done.adapter else "the policy"
    print(f"{done.directory}: {what} of step {done.step} in {done.dtype}")
    print(f"serve it with: {done.serve}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
