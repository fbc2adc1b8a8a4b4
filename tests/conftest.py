"""Test tiers as markers, from the directory a test lives in: `pytest -m unit` (no
cluster), `-m trainer` (Ray and vLLM on this machine), `-m controlplane` (a real
Kubernetes control plane), `-m gpu` (CUDA devices: `make test-gpu` on a GPU node; it skips,
saying why, everywhere else, CI too). `slow` marks tests over about 20 s (by hand, where they are).

`make test` runs three pytest-xdist workers, one group of tests at a time each: a module,
or the whole control-plane tier (which shares one control plane). The tier has a worker
of its own (tests/lanes.py); two trainer groups run side by side on the others. A
trainer run spends about 40% of its start-up waiting (Ray's nodes, vLLM's engine
process), and the control plane's tests wait on the cluster, so the three keep two
cores busy."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
TIERS = ("unit", "trainer", "controlplane", "gpu")
# CI's budget (.ci/run): a test marked slow past this is named at the end of the run.
SLOW_BUDGET_S = 300.0
# Set by .ci/run: a tier that cannot run here (no real node, no Kueue) fails, not skips.
REQUIRE_EVERY_TIER = os.environ.get("RLHF_REQUIRE_EVERY_TIER") == "1"


def needs(missing: str | None) -> pytest.MarkDecorator:
    """Mark tests that need what `missing` says is absent (None: nothing is): they skip,
    or fail in CI, with that reason (`pytestmark = needs(...)`)."""
    return pytest.mark.needs(missing)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        if mark.args[0] is not None:
            skip_or_fail(mark.args[0])


def skip_or_fail(reason: str) -> None:
    """Skip, saying why, where a tier cannot run; in CI (RLHF_REQUIRE_EVERY_TIER=1) fail."""
    if REQUIRE_EVERY_TIER:
        pytest.fail(f"required in CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups from the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)
        # Module- and session-scoped set-up (a trained run, a control plane) is built
        # once per xdist worker: a group keeps the tests that share it on one worker.
        group = tier if tier == "controlplane" else item.path.relative_to(TESTS).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


# --- the slow tests' budget: set-up, call and tear-down of each test, added up ---

_seconds: defaultdict[str, float] = defaultdict(float)
_slow: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration
    if "slow" in report.keywords:
        _slow.add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    summarise_by_module(terminalreporter)
    over = sorted(
        ((seconds, test) for test, seconds in _seconds.items()
         if test in _slow and seconds > SLOW_BUDGET_S),
        reverse=True,
    )  # fmt: skip
    if not over:
        return
    terminalreporter.section("slow tests over the budget")
    for seconds, test in over:
        terminalreporter.write_line(
            f"{seconds:6.0f} s  {test} (marked slow: each stays under {SLOW_BUDGET_S:.0f} s)"
        )


MODULES_SHOWN = 15


def summarise_by_module(terminalreporter: pytest.TerminalReporter) -> None:
    """Where a run's time went: seconds by tier and the costliest modules (set-up, calls
    and tear-down added up; the workers overlap, so on three they add to three times the
    wall time at most). What to cut first when CI nears its budget: on 2 busy cores, by
    their CPU-seconds (`PYTEST_ADDOPTS="-p tests.cpu_by_test"`) more than by these."""
    if len(_seconds) < 2:
        return
    modules: defaultdict[str, float] = defaultdict(float)
    for test, seconds in _seconds.items():
        modules[test.split("::")[0]] += seconds
    tiers: defaultdict[str, float] = defaultdict(float)
    for module, seconds in modules.items():
        tiers[Path(module).parts[1] if module.startswith("tests/") else "other"] += seconds
    terminalreporter.section("seconds by tier and module")
    terminalreporter.write_line("  ".join(f"{t} {s:.0f} s" for t, s in sorted(tiers.items())))
    for module, seconds in sorted(modules.items(), key=lambda m: -m[1])[:MODULES_SHOWN]:
        terminalreporter.write_line(f"{seconds:6.0f} s  {module}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """With three workers, the control-plane tier gets one to itself (tests/lanes.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.lanes import ControlPlaneLane  # xdist's: only where xdist runs

    return ControlPlaneLane(config, log)
