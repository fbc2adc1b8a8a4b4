"""Turn user input (YAML text or a parsed object) into a validated RLHFJob, or field errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml
from pydantic import ValidationError

from rlhf_operator.api.job import RLHFJob, RLHFJobSpec
from rlhf_trainer.api.memory_report import memory_errors
from rlhf_trainer.api.output_path import output_path_errors, read_paths
from rlhf_trainer.api.rules import FieldError, field_errors


class InvalidJob(ValueError):
    """A manifest or spec that fails validation; `errors` name each field at fault."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


def parse_job(manifest: Any, memory: bool = True) -> RLHFJob:
    """Validate a whole RLHFJob manifest (apiVersion, kind, metadata, spec); `memory`:
    with the memory rule (`rlhfjob plan` shows a job that cannot fit, and why)."""
    if not isinstance(manifest, dict):
        raise InvalidJob(
            [FieldError("", f"expected a mapping (an RLHFJob), got {_kind(manifest)}")]
        )
    try:
        job = RLHFJob.model_validate(manifest)
    except ValidationError as error:
        raise InvalidJob(field_errors(error)) from None
    check_output_path(job.spec)
    if memory:
        check_memory(job.spec)
    return job


def parse_spec(spec: Any) -> RLHFJobSpec:
    """Validate just a spec, as the operator receives it from the API server."""
    try:
        parsed = RLHFJobSpec.model_validate(spec)
    except ValidationError as error:
        raise InvalidJob(field_errors(error, prefix=("spec",))) from None
    check_output_path(parsed)
    check_memory(parsed)
    return parsed


def check_memory(spec: RLHFJobSpec) -> None:
    """The rules that only Python checks, after the schema's and CEL's: the roles on
    each pool fit its GPUs' memory (api.memory_report). CEL could not afford the arithmetic."""
    if errors := memory_errors(spec):
        raise InvalidJob([FieldError(f"spec.{e.path}", e.message) for e in errors])


def check_output_path(spec: RLHFJobSpec) -> None:
    """output.path away from what an export would delete: the checkpoints (on the
    claim's mount by default), the models and the data (api.output_path). Python only:
    CEL cannot normalise paths."""
    if errors := output_path_errors(spec, spec.checkpoint_path, prefix="spec."):
        raise InvalidJob(errors)


def unmounted_paths(spec: RLHFJobSpec) -> list[FieldError]:
    """Absolute model and data paths that no volume of the job mounts: valid, but the
    pods will not find them (a warning, not an error: the image may carry them)."""
    mounted = [v.mount_path for v in spec.pods.volumes or []]
    if spec.checkpoint_claim and spec.checkpoint_path:
        mounted.append(spec.checkpoint_path)
    return [
        FieldError(f"spec.{field}", f"{path} is under no volume the pods mount (spec.pods.volumes)")
        for field, path in read_paths(spec).items()
        if not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounted)
    ]


def load_documents(text: str) -> Iterator[Any]:
    """YAML documents of a file, skipping empty ones; a YAML syntax error is an InvalidJob."""
    try:
        docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as error:
        raise InvalidJob([FieldError("", f"not valid YAML: {error}")]) from None
    if not docs:
        raise InvalidJob([FieldError("", "no YAML document found")])
    yield from docs


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
