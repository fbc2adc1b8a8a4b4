"""An export's directory, replaced whole or not at all (roles.hf_export writes what is
in it): written into `.tmp-<name>` beside it, synced, then renamed in place of the
previous export; only a directory that carries the project's marker is replaced, and
the volume must have room for the new export beside the previous one."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_trainer.roles import checkpoint

STAGING_PREFIX = ".tmp-"  # + the export's name: being written
REPLACED_PREFIX = ".old-"  # + the export's name: the previous export, being replaced
MARKER = ".rlhf-export.json"  # in every export: a directory only an export replaces
SPACE_MARGIN = 64 << 20  # bytes beyond the weights: config, tokenizer, README, marker


class ExportError(Exception):
    """The export cannot be made: the message names the path and what was expected."""


@dataclass(frozen=True)
class Export:
    """A finished export: where it is, the step it holds and its dtype."""

    directory: Path
    step: int
    dtype: str
    adapter: bool = False  # the LoRA adapter alone (peft's format), not a whole model
    serve: str = field(default="", compare=False)  # the `vllm serve` command (hf_serve)


def check_free_space(staging: Path, target: Path, weights_bytes: int) -> None:
    """Fail before writing, naming the paths and the bytes, when the volume of
    `staging` lacks room for an export of `weights_bytes` of weights (and SPACE_MARGIN
    for its other files). The new export is written beside the previous one at `target`,
    which is removed only once the new one is renamed in: at the peak the volume holds
    both, about twice the model's size."""
    needed = weights_bytes + SPACE_MARGIN
    free = shutil.disk_usage(staging).free
    if free < needed:
        raise ExportError(
            f"{target}: not enough free space for the export: it needs about {needed} bytes "
            f"({needed / 2**30:.1f} GiB) in {staging.parent} and {free} bytes "
            f"({free / 2**30:.1f} GiB) are free there (it is written beside the previous "
            "export, then renamed in place of it: at the peak the volume holds both)"
        )


def start_export(target: Path) -> Path:
    """A fresh staging directory beside `target`; the error names the path when it
    cannot be written, or when `target` holds something other than an export (only a
    directory with the marker, or an empty one, is replaced). A previous export left
    aside by a crash is put back first."""
    staging = target.parent / (STAGING_PREFIX + target.name)
    replaced = target.parent / (REPLACED_PREFIX + target.name)
    try:
        if replaced.is_dir() and not target.exists():
            os.rename(replaced, target)  # a crash between finish_export's two renames
        check_replaceable(target)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    except OSError as error:
        raise ExportError(f"{target}: cannot write the export here: {error}") from None
    return staging


def check_replaceable(target: Path) -> None:
    """An export replaces `target` whole: only where nothing is, an empty directory, or
    a directory that a previous export marked as one (MARKER)."""
    if not target.exists():
        return
    if not target.is_dir():
        raise ExportError(f"{target}: exists and is not a directory")
    if not (target / MARKER).is_file() and any(target.iterdir()):
        raise ExportError(
            f"{target}: holds files and is not an export of this project (no {MARKER} in "
            "it); an export replaces its directory whole, so it is never written over "
            "anything else: choose another output.path (or DIR), or empty this one"
        )


def write_marker(directory: Path, export: Export) -> None:
    """The marker that says `directory` is an export, and which: what may be replaced."""
    fields = {"step": export.step, "dtype": export.dtype, "adapter": export.adapter}
    (directory / MARKER).write_text(json.dumps({"writer": "rlhf-operator"} | fields) + "\n")


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
