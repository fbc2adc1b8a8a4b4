"""Where `output.path` may not be: an export replaces its directory whole (the previous
export is renamed aside and removed), so a path that holds the checkpoints, a model
the job reads or its data, or lies inside one of them, would delete them.

Checked at admission (`rlhfjob validate`, the operator: `output_path_errors` on the
spec's paths as written) and at the job's start (roles.export_check: the same rule on
the paths as the file system resolves them, symbolic links followed).
Importable without torch (the operator imports it).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.rules import FieldError

# A checkpoint's directory below the root, committed or being written or removed
# (roles.checkpoint's names): an export there would be taken for one, or pruned.
CHECKPOINT_NAME = re.compile(r"^(\.tmp-|\.del-)?step-\d+$")


def normalized(path: str) -> str:
    """An absolute path as written, normalised ("//a/./b/" is "/a/b"; POSIX's
    normpath keeps a leading "//")."""
    return "/" + posixpath.normpath(path).lstrip("/")


def read_paths(config: JobConfig) -> dict[str, str]:
    """The local paths the job reads, by their fields: the models' and the data's
    (a hub id, 'toy:' data and relative paths are left out: no directory to compare)."""
    models = config.models
    named = {
        "models.actor.path": models.actor.path,
        "models.ref.path": models.ref.path if models.ref else None,
        "models.critic.path": models.critic.path if models.critic else None,
        "models.reward.path": models.reward.path,
        "data.train": config.data.train,
        "data.eval": config.data.eval,
    }
    return {field: path for field, path in named.items() if path and path.startswith("/")}


def output_path_errors(
    config: JobConfig,
    checkpoint_root: str | None,
    resolve: Callable[[str], str] = normalized,
    prefix: str = "",
) -> list[FieldError]:
    """What is wrong with `config.output.path` beside the job's other paths, each error
    at `prefix`output.path naming the other field: it may not hold, equal or lie inside
    a model or data path, nor hold or equal the checkpoint root (`checkpoint_root`:
    where the checkpoints go, None for none), nor lie inside one of its checkpoints.
    Below the root, beside the checkpoints, is fine (the examples' /checkpoints/model).
    `resolve`: how a path is compared (as written, or as the file system resolves it)."""
    if config.output is None:
        return []
    output = resolve(config.output.path)
    messages = [
        f"{relation(output, resolve(path))} {prefix}{name} ({path}): {DELETES} it"
        for name, path in read_paths(config).items()
        if overlaps(output, resolve(path))
    ]
    if checkpoint_root is not None:
        messages += checkpoint_conflicts(
            output, resolve(checkpoint_root), f"{prefix}trainer.checkpoint.path ({checkpoint_root})"
        )
    field = f"{prefix}output.path"
    return [FieldError(field, f"{m} (got {config.output.path})") for m in messages]


DELETES = "an export replaces its directory whole, and would delete"


def checkpoint_conflicts(output: str, root: str, named: str) -> list[str]:
    """output.path against the checkpoint root `root` (`named`: its field and path as
    written): not the root nor above it, nor inside a checkpoint's own directory."""
    if below(root, output):
        return [f"{relation(output, root)} the checkpoint root {named}: {DELETES} the checkpoints"]
    if below(output, root) and CHECKPOINT_NAME.match(inside(output, root)[0]):
        return [
            f"lies in a checkpoint's directory below {named}, which the job writes and "
            f"prunes; choose a name that is not step-N (e.g. {posixpath.join(root, 'model')})"
        ]
    return []


def below(path: str, directory: str) -> bool:
    """`path` is `directory` or lies inside it (both normalised, absolute)."""
    return directory == "/" or path == directory or path.startswith(directory + "/")


def overlaps(a: str, b: str) -> bool:
    """One of `a` and `b` holds the other, or they are the same."""
    return below(a, b) or below(b, a)


def inside(path: str, directory: str) -> list[str]:
    """The names of `path` below `directory` (which holds it)."""
    rest = path.removeprefix(directory).strip("/")
    return rest.split("/") if rest else [""]


def relation(output: str, other: str) -> str:
    """How output.path stands to `other`, in words, for an error."""
    if output == other:
        return "is"
    return "holds" if below(other, output) else "lies inside"
