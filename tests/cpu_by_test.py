"""CPU-seconds by test and by module, for deciding what to cut when CI nears its budget
(`PYTEST_ADDOPTS="-p tests.cpu_by_test" make test`).

On CI's 2 busy cores a run lasts its CPU over 2, and a test's wall time says little: one
that waits on a cluster is slow and cheap, and two that train side by side each look
twice as long as they are. Each pytest process (each xdist worker) moves itself into a
cgroup of its own, so the Ray clusters, engines and servers it starts count with it
wherever they are reparented, and reads the group's usage around every test. Needs root
and cgroup v1's `cpuacct` (as on CI's machines); elsewhere it says why and measures
nothing.

The control-plane tier is left out: a process joins its group at its first test
elsewhere, so the control plane, its real node and their pods stay where they are. With
the lane worker moved too, the walk-through failed twice in two runs (2026-12-01), and
passed without: unexplained, so its processes are not moved.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
PROPERTY = "cpu_seconds"  # a report's user property: its phase's CPU, where it ran
SHOWN = 20
PLUGIN = "cpu_by_test_plugin"
LEFT_OUT = "controlplane"  # tests/controlplane: the tier whose processes stay put


class CpuByTest:
    def __init__(self) -> None:
        self.group: Path | None = None
        self.why_not = ""
        self.mark = 0.0
        self.by_test: defaultdict[str, float] = defaultdict(float)

    def join_a_group_of_its_own(self) -> None:
        name = f"rlhf-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
        for earlier in CPUACCT.glob("rlhf-tests-*"):  # groups of runs that have ended
            if not Path("/proc", earlier.name.rpartition("-")[2]).exists():
                with contextlib.suppress(OSError):
                    earlier.rmdir()  # fails while a process of that run is left in it
        try:
            group = CPUACCT / name
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as error:
            self.why_not = f"no cgroup of its own under {CPUACCT}: {error}"
            return
        self.group = group

    def leave_its_group(self) -> None:
        """Back to the root group; the group goes once nothing of the run is left in it."""
        if self.group is not None:
            with contextlib.suppress(OSError):
                (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
                self.group.rmdir()

    def usage(self) -> float:
        assert self.group is not None
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        left_out = LEFT_OUT in item.path.parts
        if left_out and self.group is not None:  # a worker with no lane: out, for that tier
            self.leave_its_group()
            self.group = None
        elif not left_out and self.group is None and not self.why_not:
            self.join_a_group_of_its_own()
            if self.group is not None:
                self.mark = self.usage()

    @pytest.hookimpl(tryfirst=True)  # in an xdist worker, before xdist sends the report on
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        measured = dict(report.user_properties).get(PROPERTY)
        in_tier = LEFT_OUT not in Path(report.fspath).parts
        if measured is None and self.group is not None and in_tier:  # where the test ran
            now = self.usage()
            measured, self.mark = now - self.mark, now
            report.user_properties.append((PROPERTY, measured))
        if isinstance(measured, float):
            self.by_test[report.nodeid] += measured

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.section("CPU-seconds by module and test (tests/cpu_by_test.py)")
        terminalreporter.write_line(f"tests/{LEFT_OUT}/ left out: its processes are not moved")
        if not self.by_test:
            terminalreporter.write_line(f"nothing measured: {self.why_not}")
            return
        modules: defaultdict[str, float] = defaultdict(float)
        for test, seconds in self.by_test.items():
            modules[test.split("::")[0]] += seconds
        terminalreporter.write_line(f"{sum(modules.values()):7.1f} CPU-s in all")
        for module, seconds in sorted(modules.items(), key=lambda m: -m[1])[:SHOWN]:
            terminalreporter.write_line(f"{seconds:7.1f}  {module}")
        for test, seconds in sorted(self.by_test.items(), key=lambda t: -t[1])[:SHOWN]:
            terminalreporter.write_line(f"{seconds:7.1f}  {test}")


def pytest_configure(config: pytest.Config) -> None:
    plugin = CpuByTest()
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        # xdist's controller runs no test: its workers measure, it adds up their reports.
        plugin.why_not = f"no worker could make a cgroup of its own under {CPUACCT}"
    config.pluginmanager.register(plugin, PLUGIN)


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.pluginmanager.get_plugin(PLUGIN)
    if plugin is not None:
        plugin.leave_its_group()
