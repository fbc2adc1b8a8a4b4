"""Every panel of the operator dashboard, run against a real Prometheus scraping a real
operator that reconciles a job on the real control plane.

The job is suspended: its status still lists its pools' GPUs, and it holds none of the
shared fake nodes' GPUs that other tests need.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from monitoring.dashboards import OPERATOR
from tests.conftest import needs
from tests.prometheus import BINARY, Prometheus, Target

from .harness import REPO_ROOT, ControlPlane
from .operator_process import OperatorProcess
from .util import eventually, get_json

pytestmark = needs(None if BINARY.exists() else "no Prometheus: make controlplane")


@pytest.fixture
def operator(controlplane: ControlPlane) -> Iterator[OperatorProcess]:
    op = OperatorProcess(controlplane, "rlhf-operator-dashboard").start()
    yield op
    op.stop()


def test_every_operator_panel_returns_data(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    job = yaml.safe_load((REPO_ROOT / "examples" / "local-cpu.yaml").read_text())
    job["spec"]["suspend"] = True
    controlplane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))
    name = job["metadata"]["name"]
    eventually(
        lambda: (
            get_json(controlplane, "rlhfjob", name, "-n", namespace).get("status", {}).get("pools")
        ),
        "the job's pools in its status",
    )
    # As the chart's ServiceMonitor does: the operator's own namespace label wins.
    target = Target(operator.port, {"namespace": "rlhf-system"}, honor_labels=True)
    with Prometheus(tmp_path, [target]) as prometheus:
        found = prometheus.wait_for(f'rlhf_pool_gpus{{rlhfjob="{name}", state="desired"}}')
        assert {s["metric"]["namespace"] for s in found} == {namespace}
        prometheus.wait_for_scrapes(2)  # a rate needs two
        assert prometheus.panels_without_data(OPERATOR) == {}
