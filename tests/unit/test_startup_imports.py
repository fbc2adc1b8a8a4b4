"""bench/overhead/startup.py's split of a run's CPU by process: each process's kind from
its command line, a Ray worker's by the actor its log names (RankHost's repr says its
role), and the import profile's record of what a process imported and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.overhead.startup import PROFILE_VARIABLE, kind_of, ray_log_dir, worker_actor
from rlhf_trainer.api.config import Role
from rlhf_trainer.cluster.rank_host import RankHost
from rlhf_trainer.worker import RankInfo

REPO = Path(__file__).parents[2]
RAY = "/venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize(
    ("command", "parent", "actor", "kind"),
    [
        (["python", "-c", "from rlhf_operator.app.cli import main", "train"], None, None, "cli"),
        (["python", "-m", "rlhf_trainer", "--config", "job.json"], "cli", None, "driver"),
        ([f"{RAY}/core/src/ray/gcs/gcs_server", "--log_dir=/x"], "driver", None, "gcs"),
        ([f"{RAY}/core/src/ray/raylet/raylet", "--log_dir=/x"], "driver", None, "raylet"),
        (["python", f"{RAY}/dashboard/agent.py", "--node-id=1"], "raylet", None, "dashboard_agent"),
        (["python", f"{RAY}/_private/runtime_env/agent/main.py"], "raylet", None,
         "runtime_env_agent"),
        (["ray::RankHost.call"], "raylet", "critic", "critic"),
        (["ray::IDLE"], "raylet", None, "idle_worker"),
        (["ray::DashboardAgent"], "raylet", None, "dashboard_agent"),
        (["ray::RuntimeEnvAgent"], "raylet", None, "runtime_env_agent"),
        (["VLLM::EngineCore"], "rollout", None, "engine_core"),
        (["python", "-c", "from multiprocessing.resource_tracker import main"], "rollout", None,
         "rollout.child"),
        (["g++", "-O3"], "engine_core.child", None, "engine_core.child"),
    ],
)  # fmt: skip
def test_a_process_is_known_by_its_command_and_parent(
    command: list[str], parent: str | None, actor: str | None, kind: str
) -> None:
    assert kind_of(command, parent, actor) == kind


def test_a_rank_hosts_log_names_its_role(tmp_path: Path) -> None:
    """The name Ray logs for a RankHost (its repr, written once the actor is built,
    after the class's name) is the one the bench reads the role from."""
    host = RankHost(RankInfo(Role.CRITIC, "value", 1, 2), object, (), {})  # type: ignore[arg-type]
    (tmp_path / "worker-ab12-01000000-4242.out").write_text(
        f":job_id:01000000\n:actor_name:RankHost\nloading\n:actor_name:{host!r}\n"
    )
    (tmp_path / "worker-cd34-01000000-4343.out").write_text(":actor_name:SampleQueue\n")
    assert worker_actor(tmp_path, 4242) == "critic"
    assert worker_actor(tmp_path, 4343) == "queue"
    assert worker_actor(tmp_path, 4444) is None


def test_the_ray_logs_are_where_the_raylet_was_told() -> None:
    commands = [["python", "-m", "rlhf_trainer"], [f"{RAY}/raylet", "--log_dir=/tmp/s/logs"]]
    assert ray_log_dir(commands) == Path("/tmp/s/logs")
    assert ray_log_dir(commands[:1]) is None


def test_a_profiled_process_records_its_imports_and_what_brought_them_in(
    tmp_path: Path,
) -> None:
    """Through a sitecustomize, as a profiled run installs it: importing a module of
    rlhf_trainer brings in its packages (rlhf_trainer is one of WATCHED) within that import."""
    hook = tmp_path / "sitecustomize.py"
    hook.write_text("from bench.overhead.startup import record_imports\nrecord_imports()\n")
    code = "import rlhf_trainer.api.names, time; time.sleep(1.2)"  # a record is written since
    environment = os.environ | {
        PROFILE_VARIABLE: str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
    }
    run = subprocess.Popen([sys.executable, "-c", code], env=environment)
    assert run.wait() == 0
    record = json.loads((tmp_path / f"{run.pid}.json").read_text())
    assert record["argv"] == ["-c"]
    by = ["rlhf_trainer.api.names", "rlhf_trainer.api"]  # each parent package first
    assert record["watched"]["rlhf_trainer"]["by"] == by
    outermost = record["top"]["rlhf_trainer.api.names"]
    assert outermost >= record["watched"]["rlhf_trainer"]["cpu_s"]
    assert record["cpu_s"] >= record["imports_cpu_s"] >= outermost > 0
    assert "torch" not in record["watched"]
