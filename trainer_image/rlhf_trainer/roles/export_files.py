"""The files of an export beside its weights (config.json, generation_config.json, the
tokenizer's), built from the actor's spec alone, and `check_export`, which saves them
at a job's start, in the driver, so that an export that would fail at the end fails now.

No model and no peft here (roles.hf_export writes the weights), and transformers is
imported where it is used: the driver imports this module (tests/unit/test_driver_imports.py).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.output_path import output_path_errors
from rlhf_trainer.api.sections import ModelSource
from rlhf_trainer.models import load_tokenizer, save_tokenizer
from rlhf_trainer.roles.export_dir import ExportError, start_export

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig

log = logging.getLogger(__name__)


def hf_config(actor: ModelSource) -> PretrainedConfig:
    from transformers import AutoConfig

    assert actor.path is not None  # the spec's rules: exactly one of path or tiny
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(actor.path)
        return config
    except OSError as error:
        raise ExportError(
            f"models.actor.path {actor.path}: cannot read the model's config.json ({error}); "
            "the export reads the actor's config and tokenizer from there"
        ) from None


# What transformers refuses to save, found at the job's start.

# Flags that only sampling reads: transformers refuses to save a generation config that
# sets one without do_sample (Llama-2-era files set temperature and top_p alone).
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff",
                  "eta_cutoff")  # fmt: skip


def actor_generation_config(actor: ModelSource) -> GenerationConfig | None:
    """The actor's own generation_config.json, if its directory has one."""
    from transformers import GenerationConfig

    if actor.path is None:
        return None
    try:
        return GenerationConfig.from_pretrained(actor.path)
    except OSError:
        return None  # none: the model's, derived from its config
    except ValueError as error:
        raise ExportError(
            f"{where(actor)}'s generation_config.json: transformers refuses to load it: {error}"
        ) from None


def saveable(config: GenerationConfig, actor: ModelSource) -> GenerationConfig:
    """`config` as transformers will save it. Sampling flags without do_sample are
    repaired (do_sample set: vLLM samples with the flags whatever do_sample says, and so
    did the job's engines), with a warning that says so; anything else it refuses is an
    error naming the file and transformers' reason."""
    try:
        config.validate(strict=True)
        return config
    except ValueError as error:
        refused = error
    flags = [flag for flag in SAMPLING_FLAGS if getattr(config, flag, None) is not None]
    if flags and not config.do_sample:
        repaired = copy.deepcopy(config)
        repaired.do_sample = True
        with suppress(ValueError):
            repaired.validate(strict=True)
            log.warning(
                "%s's generation_config.json sets %s without do_sample, which transformers "
                "refuses to save: the export sets do_sample: true (sampling with them, as "
                "vLLM does)", where(actor), ", ".join(flags),
            )  # fmt: skip
            return repaired
    raise ExportError(
        f"{where(actor)}'s generation_config.json: transformers refuses to save it: {refused}"
    )


def where(actor: ModelSource) -> str:
    return f"models.actor.path {actor.path}" if actor.path else "models.actor.tiny"


def check_export(config: JobConfig) -> None:
    """At a job's start, fail now, not after the training, where the export at its end
    would fail (a job with `output`): an output.path that holds or lies in what the job
    keeps or reads, as the file system resolves them (api.output_path), a target that
    cannot be written or is not an export, and the files beside the weights
    (config.json, generation_config.json, the tokenizer's: `save_model_files`) built and
    saved in a scratch directory beside the target, then removed. Errors name the file
    and the reason."""
    output = config.output
    if output is None:
        return
    resolved = output_path_errors(config, config.trainer.checkpoint.path, os.path.realpath)
    if resolved:
        raise ExportError("; ".join(str(e) for e in resolved) + " (symbolic links followed)")
    target, actor = Path(output.path), config.models.actor
    staging = start_export(target)
    try:
        if output.lora != "adapter" or actor.lora is None:  # an adapter alone: no such files
            save_model_files(actor, staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_model_files(actor: ModelSource, directory: Path, target: Path) -> None:
    """The export's config.json, generation_config.json and tokenizer files, saved into
    `directory` as the export saves them; an error names the file and the reason.

    A tiny model's config and generation config are left out: this code builds them from
    the validated spec, and nothing in them can fail to save as a real model's files
    can, while building a model config imports transformers' model machinery (torch's
    compiler with it: 1.5 CPU-s of every local run's start, in the driver). Its
    tokenizer's files are saved, as the volume is written to."""
    steps: list[tuple[str, Callable[[], object]]] = [
        ("the tokenizer's files", lambda: save_tokenizer(load_tokenizer(actor), directory)),
    ]
    if actor.tiny is None:
        from transformers import GenerationConfig

        architecture = hf_config(actor)

        def generation() -> GenerationConfig:
            found = actor_generation_config(actor)
            return saveable(found or GenerationConfig.from_model_config(architecture), actor)

        steps = [
            ("config.json", lambda: architecture.save_pretrained(directory)),
            ("generation_config.json", lambda: generation().save_pretrained(directory)),
            *steps,
        ]
    for name, save in steps:
        try:
            save()
        except ExportError as error:
            raise ExportError(
                f"{target}: the export would fail at the job's end: {error}"
            ) from None
        except (OSError, ValueError, TypeError) as error:
            raise ExportError(
                f"{target}: the export would fail at the job's end: {name} of {where(actor)} "
                f"cannot be saved: {error}"
            ) from None
