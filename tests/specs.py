"""Small spec builders shared by tests."""

from __future__ import annotations

from typing import Any

from rlhf_trainer.config import JobConfig


def job_config(pools: list[dict[str, Any]], roles: dict[str, str], **extra: Any) -> JobConfig:
    """A valid JobConfig with the given pools and roles; other sections at test defaults."""
    spec = {
        "pools": pools,
        "roles": roles,
        "models": {"actor": {"path": "m"}, "reward": {"path": "rm"}},
        "data": {"train": "toy:copy"},
        "trainer": {"batchSize": 240, "miniBatchSize": 120},
        **extra,
    }
    return JobConfig.model_validate(spec)
