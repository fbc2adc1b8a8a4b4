"""A local run's folder: what a run on this machine leaves behind to look at.

runs/<job>/metrics.jsonl    one line per step (StepRecord)
runs/<job>/eval.jsonl       one line per held-out evaluation (EvalProgress), with data.eval
runs/<job>/trace.json       the pools' timeline (Chrome trace; open in ui.perfetto.dev)
runs/<job>/checkpoints/     unless the spec names its own checkpoint path
runs/<job>/model/           the trained policy (Hugging Face), unless the spec names output
runs/<job>/reward_kl.png    reward (training and held-out) and KL over the steps
runs/<job>/pool_busy.png    each pool's busy share over the steps
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from rlhf_trainer.algo.diagnostics import ActorStats, CriticStats, ResponseStats
from rlhf_trainer.api.progress import EvalProgress

DEFAULT_ROOT = Path("runs")


class RunFolderError(Exception):
    """The run folder cannot be written: the message names the path and the OS error."""


class StepOutcome(Protocol):
    """What a step reports (the loop's StepResult), as far as the run folder needs it."""

    @property
    def step(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def reward_mean(self) -> float: ...
    @property
    def kl(self) -> float: ...
    @property
    def kl_coef(self) -> float: ...
    @property
    def actor(self) -> ActorStats: ...
    @property
    def critic(self) -> CriticStats | None: ...
    @property
    def responses(self) -> ResponseStats: ...
    @property
    def evaluations(self) -> tuple[EvalProgress, ...]: ...
    @property
    def rollout_engines(self) -> int: ...


@dataclass(frozen=True)
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    seconds: float
    samples_per_second: float
    reward_mean: float
    kl: float
    actor: ActorStats
    critic: CriticStats | None  # None for the critic-free estimators
    responses: ResponseStats
    # busy time over wall time since the trainer started, per pool (pool_busy_ratios)
    pool_busy: dict[str, float]
    kl_coef: float = 0.0  # the KL penalty's coefficient the step used (0: before it was kept)
    rollout_engines: int = 0  # fully async: engines serving as the step ended (0: not kept)

    @classmethod
    def of(cls, result: StepOutcome, samples: int, pool_busy: dict[str, float]) -> StepRecord:
        """The record of a step that trained `samples` samples."""
        return cls(
            step=result.step,
            seconds=result.seconds,
            samples_per_second=samples / result.seconds if result.seconds > 0 else 0.0,
            reward_mean=result.reward_mean,
            kl=result.kl,
            actor=result.actor,
            critic=result.critic,
            responses=result.responses,
            pool_busy=dict(pool_busy),
            kl_coef=result.kl_coef,
            rollout_engines=result.rollout_engines,
        )

    def to_json(self) -> str:
        # NaN (e.g. the explained variance of flat returns) is no JSON number: null
        return json.dumps(_finite(asdict(self)), allow_nan=False)

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        fields = json.loads(line)
        if fields["reward_mean"] is None:  # a step with no reward (every sample unscored)
            fields["reward_mean"] = math.nan
        critic = fields["critic"]
        fields["actor"] = ActorStats(**_nan_for_null(fields["actor"]))
        fields["critic"] = CriticStats(**_nan_for_null(critic)) if critic else None
        fields["responses"] = ResponseStats(**fields["responses"])
        return cls(**fields)


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _nan_for_null(stats: dict[str, Any]) -> dict[str, Any]:
    return {key: math.nan if value is None else value for key, value in stats.items()}


@dataclass(frozen=True)
class RunFolder:
    path: Path

    @classmethod
    def default(cls, job: str) -> RunFolder:
        return cls(DEFAULT_ROOT / job)

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def evals(self) -> Path:
        return self.path / "eval.jsonl"

    @property
    def trace(self) -> Path:
        return self.path / "trace.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def reward_chart(self) -> Path:
        return self.path / "reward_kl.png"

    @property
    def busy_chart(self) -> Path:
        return self.path / "pool_busy.png"

    def create(self) -> None:
        """Make the folder and prove it writable, before any training starts."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".writable"
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            reason = error.strerror or str(error)
            raise RunFolderError(f"run folder {self.path}: cannot write to it: {reason}") from None

    def records(self) -> list[StepRecord]:
        if not self.metrics.is_file():
            return []
        lines = self.metrics.read_text().splitlines()
        return [StepRecord.from_json(line) for line in lines if line.strip()]

    def evaluations(self) -> list[EvalProgress]:
        if not self.evals.is_file():
            return []
        lines = self.evals.read_text().splitlines()
        return [EvalProgress.model_validate_json(line) for line in lines if line.strip()]

    def append(self, record: StepRecord) -> None:
        with self.metrics.open("a") as file:
            file.write(record.to_json() + "\n")

    def append_eval(self, evaluation: EvalProgress) -> None:
        with self.evals.open("a") as file:
            file.write(json.dumps(evaluation.to_dict()) + "\n")

    def forget_after(self, step: int) -> None:
        """Drop the records of steps (and evaluations) after `step`: a resumed run trains
        them again, from its checkpoint, so each step keeps one line."""
        records = self.records()
        kept = [r for r in records if r.step <= step]
        if len(kept) < len(records):
            self.metrics.write_text("".join(r.to_json() + "\n" for r in kept))
        evaluations = self.evaluations()
        kept_evals = [e for e in evaluations if e.step <= step]
        if len(kept_evals) < len(evaluations):
            self.evals.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in kept_evals))
