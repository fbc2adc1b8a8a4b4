"""A whole job trained on a simulated local Ray cluster, with what it reported: the
steps, the metrics and the Chrome trace (written beside its checkpoints); and the
rollout engines' vLLM series among those metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import plan_placement
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.report import ConsoleReporter


@dataclass(frozen=True)
class Trained:
    config: JobConfig
    steps: list[StepResult]
    metrics: TrainerMetrics
    trace: dict[str, Any]


def train(config: JobConfig, metrics: TrainerMetrics | None = None) -> Trained:
    """Train the job to its end; `metrics`: the registry to report into (one of its own
    by default)."""
    from rlhf_trainer.cluster.local import local_ray_cluster
    from rlhf_trainer.loop.run import run_job

    steps: list[StepResult] = []
    metrics = metrics or TrainerMetrics(pools=[p.name for p in config.pools])
    trace = Path(config.trainer.checkpoint.path) / "trace.json"
    with local_ray_cluster(config):
        run_job(config, "local", ConsoleReporter(every=1e9), metrics, trace, steps.append)
    return Trained(config, steps, metrics, json.loads(trace.read_text()))


def vllm_series(config: JobConfig, registry: CollectorRegistry, name: str) -> list[float]:
    """One rlhf_vllm_ series's values, one per rollout engine in rank order: each engine
    must have it, labelled with the rollout's pool and the engine's rank."""
    rollout = plan_placement(config).roles[Role.ROLLOUT]
    values = [
        registry.get_sample_value(name, {"pool": rollout.pool, "engine": str(rank)})
        for rank in range(rollout.data_parallel_size)
    ]
    assert None not in values, f"{name} per engine: {values}"
    return [value for value in values if value is not None]
