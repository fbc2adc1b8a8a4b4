"""Atomic checkpoints of a training run.

Layout under the checkpoint root (`CheckpointConfig.path`, a shared volume):

    step-00000010/          a committed checkpoint: complete, never changed again
    .tmp-step-00000020/     being written: the roles' state, then the driver's
    .del-step-00000000/     being removed by `prune`

A committed checkpoint holds each trained role's state (`actor/`, `critic/`), the
driver's (`trainer_state.json`) and the job's config it was written with (`job.json`:
what `python -m rlhf_trainer.export` needs to rebuild the policy's architecture).

A checkpoint is written into its staging directory and committed by one `os.rename`,
which is atomic on POSIX: a crash at any point leaves either the whole checkpoint or
none, and `latest` only ever sees committed ones. The driver owns the directory
(staging, commit, prune); the roles' ranks write their state into it as a collective
(`save_role_state`), with torch.distributed.checkpoint (DCP), whose files are per
shard and carry the layout, so N ranks' checkpoint loads on M ranks.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.progress import EvalProgress

COMMITTED_PREFIX = "step-"
STAGING_PREFIX = ".tmp-"  # + the committed name
DELETING_PREFIX = ".del-"  # + the committed name
STEP_DIGITS = 8  # zero-padded, so names sort like steps
_STEP_NAME = rf"{COMMITTED_PREFIX}(\d{{{STEP_DIGITS},}})"
_COMMITTED_NAME = re.compile(rf"^{_STEP_NAME}$")
# Staging and half-deleted checkpoints: prune removes these names and no others.
_LEFTOVER_NAME = re.compile(rf"^(\.tmp-|\.del-){_STEP_NAME}$")
TRAINER_STATE_FILE = "trainer_state.json"
JOB_CONFIG_FILE = "job.json"


def committed_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint step cannot be negative: {step}")
    return f"{COMMITTED_PREFIX}{step:0{STEP_DIGITS}d}"


def step_of(path: Path) -> int:
    """The step of a committed checkpoint directory, from its name."""
    match = _COMMITTED_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a committed checkpoint (step-NNNNNNNN)")
    return int(match.group(1))


def staging_dir(root: Path, step: int) -> Path:
    """A fresh, empty directory to write the checkpoint of `step` into. A leftover one
    (a crash while writing it) is removed first: its contents are incomplete."""
    staging = staging_path(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit(root: Path, step: int) -> Path:
    """Make the staged checkpoint of `step` durable and visible; returns its path.

    Refuses to replace a committed checkpoint (rename would silently replace an empty
    one, and a non-empty one means two writers of the same step).
    """
    staging = staging_path(root, step)
    final = root / committed_name(step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} is already committed")
    if not staging.is_dir():
        raise FileNotFoundError(f"no staged checkpoint {staging} to commit")
    # The files must be on disk before the name that says "complete" is; then the
    # rename itself must be, which is the root directory's entry.
    fsync_tree(staging)
    os.rename(staging, final)
    fsync(root)
    return final


def committed(root: Path) -> list[Path]:
    """The committed checkpoints, oldest first; staging and other names are ignored."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _COMMITTED_NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=step_of)


def latest(root: Path) -> Path | None:
    """The committed checkpoint of the highest step, or None: where to resume from."""
    found = committed(root)
    return found[-1] if found else None


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` committed checkpoints, and every staging
    directory (call it when no checkpoint is being written: after `commit`). Returns the
    committed checkpoints removed."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    old = committed(root)[:-keep]
    for path in old:
        # Renamed away first, so a crash mid-delete never leaves a half checkpoint
        # under a committed name.
        doomed = root / (DELETING_PREFIX + path.name)
        os.rename(path, doomed)
    if root.is_dir():
        for leftover in root.iterdir():
            if _LEFTOVER_NAME.match(leftover.name):
                shutil.rmtree(leftover, ignore_errors=True)
    return old


def staging_path(root: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before its commit (not created)."""
    return root / (STAGING_PREFIX + committed_name(step))


def fsync_tree(directory: Path) -> None:
    """Put every file and directory entry under `directory` on disk."""
    # Cheap for files their writer already synced (DCP does, save_json does); needed
    # for any other writer. Directories too: their entries are what rename publishes.
    for dirpath, _, filenames in os.walk(directory):
        for filename in filenames:
            fsync(Path(dirpath) / filename)
        fsync(Path(dirpath))


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Role state: a collective over the role's ranks. Only what trains is kept: a LoRA'd
# model's frozen base is built again from the spec's model, so its checkpoint holds the
# adapter and the optimizer's state (megabytes); a model that trains all its weights
# has no frozen parameter, and keeps them all.
#
# DCP and the sharding are imported in these functions, which the ranks alone call: the
# driver imports this module for its own state, and DCP would cost it 0.5 CPU-s (it
# imports FSDP and sympy).


def _trained_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from rlhf_trainer.roles.sharding import without_frozen

    trained_only = StateDictOptions(ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=trained_only)
    return {"model": without_frozen(model, model_state), "optimizer": optimizer_state}


def save_role_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the model's and the optimizer's state, each rank its own shards, into
    `directory`. Every rank of the role calls it; it returns once all have written."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_save(_trained_state(model, optimizer), checkpoint_id=directory)


def load_role_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `save_role_state` wrote into the (sharded) model and optimizer, in
    place. The ranks' count may differ from the writers': DCP reshards on load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    # The current state gives DCP the shapes and the shards this rank wants; it loads
    # into those tensors in place, and set_state_dict puts them into model/optimizer.
    state = _trained_state(model, optimizer)
    dcp_load(state, checkpoint_id=directory)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        # The frozen parameters are missing from the state on purpose; DCP's load has
        # already failed on any trained one the checkpoint lacks.
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )


# Driver state: small JSON files, written by the driver alone.


def save_json(directory: Path, name: str, data: Mapping[str, Any]) -> Path:
    """Write `data` as `directory/name`, whole or not at all (temp file + replace)."""
    path = directory / name
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def load_json(directory: Path, name: str) -> Any:
    return json.loads((directory / name).read_text())


class RngState(TypedDict):
    """The random generators' states, as JSON: Python's `random` and torch's CPU one."""

    python: list[Any]  # [version, [625 ints], gauss_next]
    torch: list[int]  # the bytes of torch.get_rng_state()


def capture_rng() -> RngState:
    version, internal, gauss_next = random.getstate()
    return {
        "python": [version, list(internal), gauss_next],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng(rng: RngState) -> None:
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))


@dataclass(frozen=True)
class TrainerState:
    """The driver's progress: where the run resumes."""

    step: int  # PPO steps completed
    policy_version: int  # of the weights the rollout engine has
    data_epoch: int  # passes over the prompts begun
    data_position: int  # prompts of this epoch consumed
    rng: RngState
    kl_coef: float | None = None  # the next step's (adaptive klController); None: klCoef
    last_eval: EvalProgress | None = None  # the last held-out evaluation reported

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "data_epoch": self.data_epoch,
            "data_position": self.data_position,
            "rng": dict(self.rng),
            "kl_coef": self.kl_coef,
            "last_eval": self.last_eval.to_dict() if self.last_eval else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainerState:
        rng = data["rng"]
        return cls(
            step=int(data["step"]),
            policy_version=int(data["policy_version"]),
            data_epoch=int(data["data_epoch"]),
            data_position=int(data["data_position"]),
            rng={"python": list(rng["python"]), "torch": [int(b) for b in rng["torch"]]},
            kl_coef=data.get("kl_coef"),  # absent from checkpoints written before it
            last_eval=EvalProgress.model_validate(data["last_eval"])
            if data.get("last_eval")
            else None,
        )


def save_trainer_state(directory: Path, state: TrainerState) -> Path:
    return save_json(directory, TRAINER_STATE_FILE, state.to_json())


def load_trainer_state(directory: Path) -> TrainerState:
    return TrainerState.from_json(load_json(directory, TRAINER_STATE_FILE))


def save_job_config(directory: Path, config: JobConfig) -> Path:
    """The job's config beside its state: the spec as the trainer was given it."""
    spec = config.model_dump(mode="json", by_alias=True, exclude_none=True)
    return save_json(directory, JOB_CONFIG_FILE, spec)


def load_job_config(directory: Path) -> JobConfig | None:
    """The config a checkpoint was written with; None for one written before it was kept."""
    path = directory / JOB_CONFIG_FILE
    if not path.is_file():
        return None
    return JobConfig.model_validate_json(path.read_text())
