"""tests/cpu_by_test.py on a made-up suite, through pytest-xdist as `make test` runs it:
a test that computes is charged its CPU, one that sleeps next to none; or, where no
cgroup can be made, the summary says why."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.cpu_by_test import CPUACCT

pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import time

def test_computes():
    sum(i * i for i in range(5_000_000))  # about half a CPU-second

def test_sleeps():
    time.sleep(1)
"""


def test_a_test_is_charged_the_cpu_it_took_not_its_wall_time(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # `tests.cpu_by_test` in the subprocess
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)  # a caller's may load the plugin already
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no:randomly", "-p", "tests.cpu_by_test", "-n", "2", "--dist", "loadfile"
    )
    result.assert_outcomes(passed=2)
    output = result.stdout.str()
    assert "CPU-seconds by module and test" in output, output
    if not os.access(CPUACCT, os.W_OK):  # not root, or no cgroup v1 cpuacct
        assert "no worker could make a cgroup of its own under /sys/fs/cgroup/cpuacct" in output
        return
    charged = {name: float(s) for s, name in re.findall(r"([\d.]+)  test_suite\.py::(\w+)", output)}
    assert charged["test_computes"] >= 0.2, output
    assert charged["test_sleeps"] < charged["test_computes"] / 4, output
