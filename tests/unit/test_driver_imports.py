"""The driver (`python -m rlhf_trainer`, which `rlhfjob train` runs) orchestrates the
roles' ranks and runs no model and no engine: what it imports, every job pays in series
before its roles start. A role's module is imported in its ranks' processes alone
(cluster.rank_host.WorkerPath); vLLM in the rollout's, peft and the model code in the
trainers'.

Each check imports in a fresh interpreter, since this one has imported everything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_trainer.cluster.rank_host import WorkerPath
from rlhf_trainer.cluster.role_groups import WORKERS
from rlhf_trainer.loop.setup import STREAMING_ROLLOUT

REPO = Path(__file__).parents[2]

# What __main__ imports, as a local run (train_locally) and a RayJob's driver
# (train_on_cluster) go on to import them.
DRIVER_MODULES = [
    "rlhf_trainer.__main__",
    "rlhf_trainer.cluster.local",
    "rlhf_trainer.loop.interrupt",
    "rlhf_trainer.loop.resize",
    "rlhf_trainer.loop.run",
    "rlhf_trainer.telemetry.local_run",
    "rlhf_trainer.telemetry.metrics",
    "rlhf_trainer.telemetry.progress",
    "rlhf_trainer.telemetry.report",
    "rlhf_trainer.telemetry.run_folder",
]
# The roles' libraries, and torch's compiler (vLLM and transformers' model classes import
# it: ~1 CPU-s). torch itself the driver needs: the loop's advantages and batches.
ROLES_ONLY = [
    "peft",
    "vllm",
    "transformers",
    "transformers.modeling_utils",
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.checkpoint",
    "accelerate",
]
# What a run's inputs may add (load_inputs): transformers' tokenizer, nothing of its models.
INPUTS_ONLY = ["transformers"]

PROBE = """
import json, sys
watched = {watched!r}
for name in {modules!r}:
    __import__(name)
imported = sorted(m for m in watched if m in sys.modules)

import yaml
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.loop.setup import load_inputs
spec = yaml.safe_load(open({example!r}).read())["spec"]
spec["output"] = {{"path": {output!r}}}  # as a local run's: its export is checked
load_inputs(JobConfig.model_validate(spec), None)
print(json.dumps([imported, sorted(m for m in watched if m in sys.modules)]))
"""


@pytest.fixture(scope="module")
def driver_loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    """Which of ROLES_ONLY a fresh interpreter holds once it imported the driver's
    modules, and once it loaded the tiny example's inputs (tokenizer, prompts, reward,
    its export checked) as the driver does before any role starts."""
    example = str(REPO / "examples" / "local-cpu.yaml")
    output = str(tmp_path_factory.mktemp("run") / "model")
    code = PROBE.format(watched=ROLES_ONLY, modules=DRIVER_MODULES, example=example, output=output)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    imported, with_inputs = json.loads(done.stdout.splitlines()[-1])
    return imported, with_inputs


def test_the_driver_imports_no_role_library(driver_loaded: tuple[list[str], list[str]]) -> None:
    assert driver_loaded[0] == []


def test_a_runs_inputs_take_transformers_tokenizer_alone(
    driver_loaded: tuple[list[str], list[str]],
) -> None:
    """The probe sees an import: the tokenizer's transformers, and none of its models."""
    assert driver_loaded[1] == INPUTS_ONLY


@pytest.mark.parametrize("named", [*WORKERS.values(), STREAMING_ROLLOUT], ids=lambda n: n.name)
def test_a_named_worker_loads_as_named(named: WorkerPath) -> None:
    assert named.load().__name__ == named.name


def test_a_worker_named_with_the_wrong_process_group_does_not_load() -> None:
    wrong = WorkerPath("rlhf_trainer.rollout.worker", "RolloutWorker", needs_process_group=True)
    with pytest.raises(TypeError, match="needs_process_group is False"):
        wrong.load()
