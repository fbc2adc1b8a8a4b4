"""One seed derivation for every stream of randomness, and one engine, built from the
spec's options, for both rollout workers (the streaming one once ran every engine at
TP=1 whatever `generation.tensorParallelSize` said)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.rollout import streaming, worker
from rlhf_trainer.worker import RankInfo, derive_seed
from tests.specs import local_async_job


def test_seeds_are_deterministic_distinct_and_31_bit() -> None:
    keys = list(itertools.product((0, 7), ("generate", "sample", "minibatches"), range(50), (0, 1)))
    seeds = [derive_seed(*key) for key in keys]
    assert seeds == [derive_seed(*key) for key in keys]
    assert len(set(seeds)) == len(keys)
    assert all(0 <= seed < 2**31 for seed in seeds)


def async_job_with_tp2(tmp_path: Path) -> JobConfig:
    spec = local_async_job(
        staleness=0.5, total_steps=1, checkpoint_dir=tmp_path, every_steps=1
    ).model_dump(by_alias=True, exclude_none=True)
    for pool in spec["pools"]:
        if pool["name"] == spec["roles"]["rollout"]:
            pool["gpusPerNode"] = 2
    spec["generation"]["tensorParallelSize"] = 2
    return JobConfig.model_validate(spec)


class EngineSpy:
    """Stands in for vLLM: records the arguments an engine is built with."""

    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, model_dir: str, **options: Any) -> None:
        EngineSpy.built.append(options)

    def shutdown(self) -> None:
        pass


def test_both_rollout_workers_build_engines_with_the_specs_tensor_parallelism(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = async_job_with_tp2(tmp_path)
    monkeypatch.setattr(EngineSpy, "built", [])
    monkeypatch.setattr(worker, "model_path", lambda source, seed: str(tmp_path))
    monkeypatch.setattr(worker, "RolloutEngine", EngineSpy)
    info = RankInfo(Role.ROLLOUT, "rollout", rank=0, world_size=1)
    worker.RolloutWorker(info, config)
    streaming.StreamingRollout(info, config, queue=None).close()
    assert [options["tensor_parallel_size"] for options in EngineSpy.built] == [2, 2]
    assert EngineSpy.built[0] == EngineSpy.built[1]
