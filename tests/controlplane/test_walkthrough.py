"""The README's walk-through, line by line, as a new user runs it: `make cluster`, the
chart, the operator, an example job, `kubectl get rlhfjobs`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import pytest

from .harness import REPO_ROOT, free_ports
from .util import eventually

PHASES = {"Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended"}


def walkthrough() -> list[str]:
    """The shell lines between the README's walk-through markers, comments stripped."""
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"<!-- walkthrough:.*?```sh\n(.*?)```", readme, re.DOTALL)
    assert block, "the README lost its walk-through block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def read_exports(output: IO[str], timeout: float = 300) -> dict[str, str]:
    """The `export NAME=value` lines `make cluster` prints once the cluster is up."""
    exports: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(exports) < 2 and time.monotonic() < deadline:
        line = output.readline()
        assert line, "make cluster exited before printing its exports"
        if match := re.match(r"\s*export (\w+)=(\S+)", line):
            exports[match.group(1)] = match.group(2)
    assert set(exports) == {"KUBECONFIG", "PATH"}, exports
    return exports


@contextmanager
def background(command: str, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        ["bash", "-c", command], cwd=REPO_ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield process
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as the README says
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def run(command: str, env: dict[str, str]) -> str:
    result = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, env=env, text=True,
                            capture_output=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow  # a second control plane: about half a minute
def test_the_readme_walkthrough_works() -> None:
    cluster, install, operator, apply, get = walkthrough()
    assert cluster == "make cluster" and operator.endswith("&"), walkthrough()
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    with background(cluster, env) as make_cluster:
        assert make_cluster.stdout is not None
        exports = read_exports(make_cluster.stdout)
        env |= {"KUBECONFIG": exports["KUBECONFIG"],
                "PATH": exports["PATH"].replace("$PATH", env["PATH"]),
                "RLHF_OPERATOR_HEALTH_PORT": str(free_ports(1)[0])}  # fmt: skip
        run(install, env)
        with background(operator.removesuffix("&"), env):
            run(apply, env)

            def job_with_a_phase() -> list[str] | None:
                rows = [line.split() for line in run(get, env).splitlines()[1:]]
                return next((row for row in rows if len(row) > 1 and row[1] in PHASES), None)

            row = eventually(job_with_a_phase, "`kubectl get rlhfjobs` to show the job's phase")
            assert row[0] == "split-8gpu"
