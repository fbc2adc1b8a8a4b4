"""Small spec builders shared by tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlhf_trainer.api.config import JobConfig


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


LOCAL_EXAMPLE = Path(__file__).parents[1] / "examples" / "local-cpu.yaml"


def local_job(
    *, colocated: bool, total_steps: int, checkpoint_dir: Path, every_steps: int
) -> JobConfig:
    """The local example's JobConfig (what the operator would hand the trainer), for a
    given number of steps; colocated puts the critic on the policy pool. Its KL
    coefficient is fixed (klCoef): the learning tests' margins were measured so."""
    spec = yaml.safe_load(LOCAL_EXAMPLE.read_text())["spec"]
    spec["algorithm"].pop("klController", None)
    if colocated:
        spec["pools"] = [p for p in spec["pools"] if p["name"] == spec["roles"]["actor"]]
        spec["roles"]["critic"] = spec["roles"]["actor"]
    spec["trainer"]["totalSteps"] = total_steps
    spec["trainer"]["checkpoint"] = {"path": str(checkpoint_dir), "everySteps": every_steps}
    return JobConfig.model_validate(spec)


def local_async_job(
    *,
    staleness: float,
    total_steps: int,
    checkpoint_dir: Path,
    every_steps: int,
    sync_every: int = 1,
    partial_rollout: bool = True,
    samples_per_prompt: int = 1,
) -> JobConfig:
    """The local example in fully-async mode: the rollout on a pool of its own, the
    actor, ref and critic on the other (one simulated GPU each). With samples_per_prompt
    n, a step trains the same number of samples: batchSize / n prompts, n each."""
    spec = local_job(
        colocated=True,
        total_steps=total_steps,
        checkpoint_dir=checkpoint_dir,
        every_steps=every_steps,
    ).model_dump(by_alias=True, exclude_none=True)
    spec["pools"].append({"name": "rollout", "replicas": 1, "gpusPerNode": 1})
    spec["roles"]["rollout"] = "rollout"
    spec["async"] = {
        "stalenessThreshold": staleness,
        "triggerParameterSyncStep": sync_every,
        "partialRollout": partial_rollout,
    }
    spec["generation"]["samplesPerPrompt"] = samples_per_prompt
    spec["trainer"]["batchSize"] //= samples_per_prompt
    return JobConfig.model_validate(spec)


def critic_free_job(
    estimator: str,
    placement: str,
    *,
    total_steps: int,
    checkpoint_dir: Path,
    samples_per_prompt: int = 4,
    algorithm: dict[str, Any] | None = None,
    reward: str | dict[str, Any] = "toy_copy",
) -> JobConfig:
    """The local example without a critic: 8 prompts a step, `samples_per_prompt`
    responses each. placement: "colocated" (one pool), "split" (the rollout on a pool
    of its own, actor and ref on the other) or "async" (split, fully asynchronous)."""
    spec = yaml.safe_load(LOCAL_EXAMPLE.read_text())["spec"]
    spec["roles"] = {"actor": "policy", "ref": "policy", "rollout": "policy"}
    if placement == "colocated":
        spec["pools"] = spec["pools"][:1]
    else:
        spec["pools"][1]["name"] = spec["roles"]["rollout"] = "rollout"
    if placement == "async":
        spec["async"] = {"stalenessThreshold": 0.5}
    spec["models"]["reward"] = reward if isinstance(reward, dict) else {"function": reward}
    spec["algorithm"] = {"klCoef": 0.01, "advantageEstimator": estimator, **(algorithm or {})}
    spec["generation"]["samplesPerPrompt"] = samples_per_prompt
    spec["trainer"].update(totalSteps=total_steps, batchSize=8, miniBatchSize=16)
    spec["trainer"]["checkpoint"] = {"path": str(checkpoint_dir), "everySteps": total_steps}
    return JobConfig.model_validate(spec)
