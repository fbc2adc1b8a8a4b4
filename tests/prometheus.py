"""A real Prometheus on loopback (Debian's build, unpacked by `make controlplane`),
scraping fixed targets every second, and the dashboards' queries run against it.

    with Prometheus(tmp, [Target(port, {"rlhfjob": "a"})]) as prometheus:
        prometheus.query("rlhf_kl")
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from monitoring.charts import Dashboard
from tests.controlplane.processes import free_ports

BINARY = Path(__file__).parent / "controlplane" / "bin" / "prometheus"
SCRAPE_SECONDS = 1

# What Grafana puts in place of the dashboards' variables when "All" is chosen, and a
# rate window spanning a short test run (with 1 s scrapes).
GRAFANA_VARIABLES = {
    "namespace": ".*",
    "job": ".*",
    "pool": ".*",
    "__rate_interval": "1m",
    "__range": "10m",
}


def as_promql(expr: str) -> str:
    """A dashboard query as Grafana sends it, its variables replaced (`$1` stays)."""
    return re.sub(r"\$(\w+)", lambda m: GRAFANA_VARIABLES.get(m[1], m[0]), expr)


class PromQLError(Exception):
    """Prometheus refused a query (a syntax or type error), with its message."""


@dataclass(frozen=True)
class Target:
    port: int  # on 127.0.0.1
    labels: dict[str, str]
    honor_labels: bool = False  # keep the target's own namespace label (the operator's)


def kubernetes_pods_job(api_server: str, pki: Path) -> dict[str, Any]:
    """A scrape job that finds the pods annotated `prometheus.io/scrape` through the API
    server (Kubernetes service discovery, as an admin), and names a job's series `rlhfjob`
    as the chart's PodMonitor does."""
    tls = {"ca_file": str(pki / "ca.crt"), "cert_file": str(pki / "admin.crt"),
           "key_file": str(pki / "admin.key")}  # fmt: skip
    return {
        "job_name": "kubernetes-pods",
        "kubernetes_sd_configs": [{"role": "pod", "api_server": api_server, "tls_config": tls}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
             "action": "keep", "regex": "true"},
            {"source_labels": ["__meta_kubernetes_pod_ip",
                               "__meta_kubernetes_pod_annotation_prometheus_io_port"],
             "separator": ":", "target_label": "__address__"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_label_rlhf_dev_job"],
             "target_label": "rlhfjob"},
        ],
    }  # fmt: skip


@dataclass
class Prometheus:
    workdir: Path
    targets: list[Target]
    port: int = field(default_factory=lambda: free_ports(1)[0])
    proc: subprocess.Popen[bytes] | None = None
    discovery: list[dict[str, Any]] = field(default_factory=list)  # more scrape jobs

    def __enter__(self) -> Prometheus:
        config = {
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s"},
            "scrape_configs": [
                {
                    "job_name": f"target-{index}",
                    "honor_labels": target.honor_labels,
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{target.port}"], "labels": target.labels}
                    ],
                }
                for index, target in enumerate(self.targets)
            ]
            + self.discovery,
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = self.workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    str(BINARY),
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def _wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"Prometheus not ready after {timeout}s:\n{self.log.read_text()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector), or PromQLError with Prometheus's reason."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:  # 400 bad_data, 422 execution error
            raise PromQLError(json.load(error).get("error", str(error))) from None
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, expr: str, timeout: float = 30) -> list[dict[str, Any]]:
        """The query's result once it has one (the next scrapes may be needed)."""
        deadline = time.monotonic() + timeout
        while not (result := self.query(expr)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no data for {expr} after {timeout}s")
            time.sleep(SCRAPE_SECONDS / 2)
        return result

    def wait_for_scrapes(self, count: int) -> None:
        """Until every target has been scraped `count` times within a minute."""
        self.wait_for(f"min(count_over_time(up[1m])) >= {count}")

    def panels_without_data(
        self, dashboard: Dashboard, multi_turn: bool = False, agent: bool = False
    ) -> dict[str, str]:
        """Each query of the dashboard's own series run as Grafana would (every variable
        at "All"): those that return nothing, by chart title. A query Prometheus refuses
        raises PromQLError. Charts of other exporters are only parsed. `multi_turn`: the
        rows of multi-turn jobs' series (Row.multi_turn) only; `agent`: those of agent
        jobs' (Row.agent) only; else every other row."""
        empty = {}
        rows = [r for r in dashboard.rows if (r.multi_turn, r.agent) == (multi_turn, agent)]
        for chart in (chart for row in rows for chart in row.charts):
            for query in chart.queries:
                try:
                    result = self.query(as_promql(query.expr))
                except PromQLError as error:
                    raise PromQLError(f"{dashboard.title} / {chart.title}: {error}") from None
                if not result and chart.exporter is None:
                    empty[chart.title] = query.expr
        return empty
