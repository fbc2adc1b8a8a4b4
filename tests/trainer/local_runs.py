"""A whole job trained on a simulated local Ray cluster, with what it reported: the
steps, the progress (what a job's status is told), the metrics and the Chrome trace
(written beside its checkpoints); a reporter that keeps what it is told; the rollout
engines' vLLM series among those metrics; and a hook that kills a run's vLLM engine."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import CollectorRegistry

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import plan_placement
from rlhf_trainer.api.progress import TrainingProgress
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.metrics import TrainerMetrics


class KeptReports:
    """A reporter that keeps what it is told: (progress, final), in order. A job's
    status is told the same, at most every few seconds."""

    def __init__(self) -> None:
        self.reports: list[tuple[TrainingProgress, bool]] = []

    def report(self, progress: TrainingProgress, final: bool = False) -> bool:
        self.reports.append((progress, final))
        return True

    @property
    def last(self) -> TrainingProgress:
        return self.reports[-1][0]


@dataclass(frozen=True)
class Trained:
    config: JobConfig
    steps: list[StepResult]
    metrics: TrainerMetrics
    trace: dict[str, Any]
    reports: list[tuple[TrainingProgress, bool]]  # (progress, final), as KeptReports


def train(
    config: JobConfig,
    metrics: TrainerMetrics | None = None,
    on_step: Callable[[StepResult], None] | None = None,
) -> Trained:
    """Train the job to its end; `metrics`: the registry to report into (one of its own
    by default); `on_step`: called after each step (after it is recorded)."""
    from rlhf_trainer.cluster.local import local_ray_cluster
    from rlhf_trainer.loop.run import run_job

    steps: list[StepResult] = []

    def record(step: StepResult) -> None:
        steps.append(step)
        if on_step is not None:
            on_step(step)

    metrics = metrics or TrainerMetrics(pools=[p.name for p in config.pools])
    trace = Path(config.trainer.checkpoint.path) / "trace.json"
    reporter = KeptReports()
    with local_ray_cluster(config):
        run_job(config, "local", reporter, metrics, trace, record)
    return Trained(config, steps, metrics, json.loads(trace.read_text()), reporter.reports)


@contextmanager
def push_skipped(version: int) -> Iterator[None]:
    """Runs inside this skip the weight push of `version` (the actor's weights after step
    `version`): the engines keep the ones before, so step `version + 1` samples with stale
    weights, and a check that the engine has the actor's weights must fail there."""
    from rlhf_trainer.loop.weights import WeightSync

    push = WeightSync.push

    def push_unless_skipped(sync: WeightSync, pushed: int) -> None:
        if pushed != version:
            push(sync, pushed)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WeightSync, "push", push_unless_skipped)
        yield


def vllm_series(config: JobConfig, registry: CollectorRegistry, name: str) -> list[float]:
    """One rlhf_vllm_ series's values, one per rollout engine that serves, in rank order:
    each must have it, labelled with the rollout's pool and the engine's rank (those
    lost have none)."""
    rollout = plan_placement(config).roles[Role.ROLLOUT]
    found = {
        int(sample.labels["engine"]): sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name and sample.labels.get("pool") == rollout.pool
    }
    assert len(found) == rollout.data_parallel_size, f"{name} per engine: {found}"
    return [found[rank] for rank in sorted(found)]


RUN_TAG = "RLHF_TEST_RUN"  # environment variable: which test run a process belongs to


def engine_cores(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The vLLM engine-core processes among `processes`.

    vLLM titles them VLLM::EngineCore, but full runs here found one untitled, twice,
    with the command line multiprocessing's spawn gave it: so a spawned child of a
    rank host (the rollout rank starts its engine core) counts too."""
    found = []
    for process in processes:
        with suppress(psutil.Error):
            command = " ".join(process.cmdline())
            parent = process.parent()
            spawned_by_rank = (
                "spawn_main" in command
                and parent is not None
                and " ".join(parent.cmdline()).startswith("ray::RankHost")
            )
            if command.startswith("VLLM::EngineCore") or spawned_by_rank:
                found.append(process)
    return found


@dataclass
class EngineKiller:
    """An on_step hook that SIGKILLs the run's one vLLM engine core, once, after step
    `after_step` (or the first step after it at which the engine is up).

    The engine is searched among all processes, not the test's children: how Ray parents
    its workers is its own business (a CI run once found no engine below pytest). It is
    told apart by `tag`, which it inherits through the local cluster's raylets when the
    cluster starts inside `tagged()`; another test worker's engines (tests run on two)
    do not have it.

    With `whole_rank`, the rollout rank's process that hosts the engine goes with it, as
    when its pod or node is lost (the engine core is its child)."""

    after_step: int = 1
    tag: str = field(default_factory=lambda: f"{os.getpid()}-{time.time()}")
    killed: list[int] = field(default_factory=list)  # the pids killed
    whole_rank: bool = False

    @contextmanager
    def tagged(self) -> Iterator[EngineKiller]:
        """Start the local cluster inside this: its processes carry the tag."""
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(RUN_TAG, self.tag)
            yield self

    def ours(self, process: psutil.Process) -> bool:
        return tag_of(process) == self.tag

    def __call__(self, step: StepResult) -> None:
        if self.killed or step.step < self.after_step:
            return
        every = engine_cores(psutil.process_iter())
        engines = [p for p in every if self.ours(p)]
        # One engine is the rollout pool's; of several, the first started goes.
        assert self.whole_rank or len(engines) <= 1, f"expected one engine, found {engines}"
        engines.sort(key=lambda process: process.create_time())
        if engines:
            victim = engines[0].parent() if self.whole_rank else engines[0]
            assert victim is not None, f"the engine core {engines[0].pid} has no parent"
            victim.kill()
            self.killed.append(victim.pid)
        assert self.killed or step.step < self.after_step + 2, (
            f"no vLLM engine tagged {self.tag} found to kill among {every}: "
            f"{[tag_of(p) for p in every]}; the run's processes: {self.tagged_processes()}"
        )

    def tagged_processes(self) -> list[str]:
        """What a failed search saw of the run (a run here once found no engine at all)."""
        return tagged_processes(self.tag)


def tag_of(process: psutil.Process) -> str | None:
    try:
        return process.environ().get(RUN_TAG)
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess) as error:
        return repr(error)


def tagged_processes(tag: str) -> list[str]:
    """The live processes of the run tagged `tag` (RUN_TAG in their environment), as
    'pid status command'."""
    seen = []
    for process in psutil.process_iter():
        with suppress(psutil.Error):
            if tag_of(process) == tag and process.status() != psutil.STATUS_ZOMBIE:
                seen.append(f"{process.pid} {process.status()} {process.cmdline()[:3]}")
    return seen
