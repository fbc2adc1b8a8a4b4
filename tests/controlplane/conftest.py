"""pytest fixtures: one real control plane for this tier (package scope: it stops after
the tier's last test, so the tests a worker runs next get the cores its idle API
server, kubelet and operators would take, ~10% of one).

    def test_x(controlplane):
        controlplane.kubectl("get", "nodes")
        v1 = kubernetes.client.CoreV1Api(controlplane.api_client())

    def test_y(real_node):  # skipped, with the reason, where no real node runs
        real_node.load_image(archive)  # then pods with on_real_node(spec) run it

When a test fails, the last lines of every component's log are added to its report.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import skip_or_fail

from .harness import RUN_ROOT, ControlPlane, build_binaries, missing_binaries
from .node import RealNode
from .operator_process import OperatorProcess
from .util import provide_example_claims, remove_example_claims

_running: ControlPlane | None = None


def _say(config: pytest.Config, line: str) -> None:
    """Print to the terminal even while pytest captures output."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line)


@pytest.fixture(scope="package")
def controlplane(request: pytest.FixtureRequest):
    global _running
    # make is a no-op when the binaries are newer than the go.mod/go.sum they come from.
    if shutil.which("go") and shutil.which("make"):
        RUN_ROOT.mkdir(parents=True, exist_ok=True)
        build_log = RUN_ROOT / "build.log"
        if missing_binaries():
            _say(
                request.config,
                f"building control-plane binaries (first time: many minutes); log: {build_log}",
            )
        build_binaries(build_log)
    cp = ControlPlane()
    _running = cp
    cp.start()
    _say(
        request.config,
        f"control plane started in {cp.startup_seconds:.1f}s {cp.phase_seconds}; "
        f"KUBECONFIG={cp.kubeconfig}",
    )
    if cp.real_node is None:
        _say(request.config, f"no real node: {cp.real_node_absent}")
    try:
        yield cp
    finally:
        cp.stop()
        _running = None


@pytest.fixture(scope="package")
def real_node(controlplane: ControlPlane) -> RealNode:
    """The control plane's real node (see node.py); skips where none could start."""
    if controlplane.real_node is None:
        skip_or_fail(f"no real node: {controlplane.real_node_absent}")
    return controlplane.real_node


@pytest.fixture(scope="module")
def operator(controlplane: ControlPlane) -> Iterator[OperatorProcess]:
    """The operator, run from this checkout as the cluster admin (test_chart runs it with
    the chart's own RBAC)."""
    op = OperatorProcess(controlplane).start()
    yield op
    op.stop()


@pytest.fixture
def namespace(controlplane: ControlPlane) -> Iterator[str]:
    """A fresh namespace per test, ready for pods (its default service account exists)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    controlplane.create_namespace(name)
    provide_example_claims(controlplane, name)  # the volumes the examples mount
    yield name
    controlplane.kubectl("delete", "namespace", name, "--wait=false", check=False)
    remove_example_claims(controlplane, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _running is not None:
        for name, text in _running.log_tails().items():
            report.sections.append((f"{name} log (last lines)", text))
