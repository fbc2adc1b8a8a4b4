"""A local run on a machine with CUDA gives each simulated node GPUs of its own
(`cluster.local.MachineGpus`): Ray hands a node's workers the ids it started with, so
two nodes never share a GPU (proven on Ray in tests/trainer/test_local_cluster.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.cluster.local import MachineGpus
from tests.specs import local_job


def job(**pool_changes: object) -> JobConfig:
    """The local example: pools policy and value, one GPU a node each."""
    spec = local_job(colocated=False, total_steps=1, checkpoint_dir=Path("/unused"), every_steps=1)
    config = spec.model_dump(by_alias=True, exclude_none=True)
    config["pools"][1] |= pool_changes
    return JobConfig.model_validate(config)


def visible_while_starting(gpus: MachineGpus, config: JobConfig, pool: str) -> str | None:
    with gpus.for_node(config, pool):
        return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_each_node_takes_devices_of_its_own_and_the_environment_is_restored() -> None:
    config = job(gpusPerNode=2)
    gpus = MachineGpus(["0", "1", "2", "3", "4"])
    assert visible_while_starting(gpus, config, "policy") == "0"
    assert visible_while_starting(gpus, config, "value") == "1,2"
    assert visible_while_starting(gpus, config, "value") == "3,4"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(ValueError, match=r"pools\[value\] needs 2 GPUs for a node, .* has 0 left"):
        visible_while_starting(gpus, config, "value")


def test_a_visible_devices_setting_is_put_back_after_a_node_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    gpus = MachineGpus(["4", "6"])
    assert visible_while_starting(gpus, job(), "value") == "4"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


@pytest.mark.parametrize("visible", [None, "", "0", "5,7"])
def test_without_cuda_nodes_start_without_the_setting_and_workers_see_no_device(
    visible: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray refuses a node with more GPUs than CUDA_VISIBLE_DEVICES lists: without CUDA the
    nodes' GPUs are logical, so they start without it (tests/trainer/test_local_cluster.py
    starts the example's cluster under each value)."""
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus = MachineGpus([])
    assert [visible_while_starting(gpus, job(gpusPerNode=16), "value") for _ in range(3)] == [
        None
    ] * 3
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
    assert gpus.worker_environment() == {"CUDA_VISIBLE_DEVICES": ""}
    assert MachineGpus(["0"]).worker_environment() == {}


def test_a_cpu_pool_on_a_cuda_machine_is_refused_naming_the_field_and_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"pools\[value\]\.device is cpu.*rlhfjob train --cpu"):
        visible_while_starting(MachineGpus(["0"]), job(device="cpu"), "value")
