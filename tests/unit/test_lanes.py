"""The control-plane lane (tests/lanes.py), run by pytest-xdist itself on a made-up suite:
a quick control-plane group and slower groups of other tests."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
from tests.lanes import ControlPlaneLane

def pytest_xdist_make_scheduler(config, log):
    return ControlPlaneLane(config, log)
"""
# The lane's tests end at once; the others take a while, so that a worker done with the
# lane would be handed one of their groups if it were not kept to its lane.
LANE_TESTS = """
import pytest

@pytest.mark.xdist_group("controlplane")
@pytest.mark.parametrize("n", range(4))
def test_lane(n):
    pass
"""
OTHER_TESTS = """
import time
import pytest

@pytest.mark.xdist_group("{group}")
@pytest.mark.parametrize("n", range(2))
def test_other(n):
    time.sleep(0.3)
"""
# "[gw1] [ 50%] PASSED test_lane.py::test_lane[0]@controlplane"
RAN = re.compile(r"\[(gw\d)\] \[\s*\d+%\] PASSED (\w+)\.py::")


def workers_by_module(pytester: pytest.Pytester, workers: int) -> dict[str, set[str]]:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_lane=LANE_TESTS)
    others = {f"test_other{i}": OTHER_TESTS.format(group=f"other{i}") for i in range(5)}
    pytester.makepyfile(**others)
    result = pytester.runpytest_subprocess(
        "-p", "no:randomly", "-v", "-n", str(workers), "--dist", "loadgroup"
    )
    result.assert_outcomes(passed=4 + 5 * 2)
    ran: defaultdict[str, set[str]] = defaultdict(set)
    for worker, module in RAN.findall(result.stdout.str()):
        ran[module].add(worker)
    return ran


@pytest.fixture
def pytester_importing_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # `tests.lanes` in the subprocess
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)  # the caller's plugins are not this suite's
    return pytester


def test_with_three_workers_the_lane_has_one_and_the_others_run_on_the_other_two(
    pytester_importing_tests: pytest.Pytester,
) -> None:
    ran = workers_by_module(pytester_importing_tests, workers=3)
    (lane_worker,) = ran.pop("test_lane")
    others = set().union(*ran.values())
    assert lane_worker not in others, dict(ran)
    assert len(others) == 2, dict(ran)


def test_with_two_workers_the_lanes_worker_takes_other_groups_too(
    pytester_importing_tests: pytest.Pytester,
) -> None:
    ran = workers_by_module(pytester_importing_tests, workers=2)
    (lane_worker,) = ran.pop("test_lane")
    assert lane_worker in set().union(*ran.values()), dict(ran)
