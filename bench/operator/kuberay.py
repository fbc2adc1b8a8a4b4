"""KubeRay's operator run on the operator's terms, and when each side has gone quiet."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tests.controlplane.harness import BIN_DIR, ControlPlane
from tests.controlplane.operator_process import OperatorProcess
from tests.controlplane.processes import Process, free_ports

# Our operator has no client-side rate limit; KubeRay's default is 100 QPS, burst 200.
UNLIMITED_QPS = 100_000
QUIET_SECONDS = 3.0  # no reconcile started for this long, and nothing queued: drained


@dataclass(frozen=True)
class KubeRay:
    process: Process
    metrics_url: str

    def samples(self, name: str) -> float:
        """The sum of every sample `name` (e.g. over its controllers' work queues)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        )

    def activity(self) -> tuple[float, float]:
        """(keys queued now, keys ever queued)."""
        return self.samples("workqueue_depth"), self.samples("workqueue_adds_total")


@contextlib.contextmanager
def matched_kuberay(cp: ControlPlane, concurrency: int) -> Iterator[KubeRay]:
    """KubeRay's operator with `concurrency` workers per controller and no rate limit,
    in place of the control plane's own (restored afterwards)."""
    metrics, probe = free_ports(2)
    argv = [
        str(BIN_DIR / "kuberay-operator"),
        f"--metrics-addr=127.0.0.1:{metrics}",
        f"--health-probe-bind-address=127.0.0.1:{probe}",
        "--enable-leader-election=false",
        "--log-stdout-encoder=console",
        "--use-kubernetes-proxy",  # as the harness runs it: outside the cluster
        f"--reconcile-concurrency={concurrency}",
        f"--qps={UNLIMITED_QPS}",
        f"--burst={UNLIMITED_QPS}",
    ]
    with cp.host_kuberay_stopped():
        process = Process("kuberay-matched", argv, cp.logs_dir / "kuberay-matched.log",
                          {"KUBECONFIG": str(cp.kubeconfig)})  # fmt: skip
        process.start()
        try:
            kuberay = KubeRay(process, f"http://127.0.0.1:{metrics}/metrics")
            wait_until(lambda: _answers(f"http://127.0.0.1:{probe}/readyz"), 60, "KubeRay")
            yield kuberay
        finally:
            process.stop()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def operator_activity(op: OperatorProcess) -> tuple[float, float]:
    """(keys queued now, reconciles ever finished)."""
    finished = op.metric("rlhf_operator_reconcile_duration_seconds_count")
    return op.metric("rlhf_operator_queue_depth"), finished


def wait_quiet(activities: list[Callable[[], tuple[float, float]]], timeout: float = 600) -> float:
    """Until every operator has nothing queued and no count moved for QUIET_SECONDS;
    the seconds it took."""
    began = time.monotonic()
    last = [probe() for probe in activities]
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < QUIET_SECONDS:
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"operators still busy after {timeout}s: {last}")
        time.sleep(0.5)
        now = [probe() for probe in activities]
        if now != last or any(depth for depth, _ in now):
            quiet_since = time.monotonic()
        last = now
    return time.monotonic() - began


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout}s")
        time.sleep(0.2)
