"""Every panel of the pools and training dashboards, run against a real Prometheus
that scraped two real local runs: PPO split (synchronous) and PPO fully async.

Both runs' metrics servers stay up after training, as a finished driver's pod would
until it exits, so the last values are still there to query. The DCGM charts need an
exporter that cannot run here: Prometheus parses them, and they are named below.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from monitoring.charts import Dashboard
from monitoring.dashboards import DCGM, POOLS, TRAINING
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import DRIVER
from rlhf_trainer.telemetry.metrics import TrainerMetrics, serve_metrics
from tests.conftest import needs
from tests.controlplane.harness import free_ports
from tests.prometheus import BINARY, Prometheus, Target
from tests.specs import local_async_job, local_job
from tests.trainer.local_runs import train

pytestmark = [
    pytest.mark.slow,  # two short runs
    needs(None if BINARY.exists() else "no Prometheus: run make controlplane"),
]

STEPS = 3
NAMESPACE = "local"  # what a PodMonitor would add as the pod's namespace


def jobs(tmp: Path) -> dict[str, JobConfig]:
    fully_async = local_async_job(
        staleness=1, total_steps=STEPS, checkpoint_dir=tmp / "async", every_steps=STEPS
    ).to_dict()
    # Two sampled answers to each held-out prompt: pass@2 as well as pass@1.
    fully_async["generation"]["eval"] = {"samplesPerPrompt": 2, "temperature": 1.0}
    return {
        "sync-ppo": local_job(
            colocated=False, total_steps=STEPS, checkpoint_dir=tmp / "sync", every_steps=STEPS
        ),
        "async-ppo": JobConfig.model_validate(fully_async),
    }


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("dashboards")
    configs = jobs(tmp)
    ports = dict(zip(configs, free_ports(len(configs)), strict=True))
    targets = [Target(ports[name], {"namespace": NAMESPACE, "rlhfjob": name}) for name in configs]
    servers = []
    with Prometheus(tmp, targets) as prometheus:
        try:
            for name, config in configs.items():
                metrics = TrainerMetrics(pools=[p.name for p in config.pools])
                servers.append(serve_metrics(metrics.registry, ports[name], addr="127.0.0.1"))
                train(config, metrics)
                samples = STEPS * config.samples_per_step
                prometheus.wait_for(f'rlhf_samples_trained_total{{rlhfjob="{name}"}} == {samples}')
            yield prometheus
        finally:
            for server in servers:
                server.shutdown()
                server.server_close()


@pytest.mark.parametrize("dashboard", [POOLS, TRAINING], ids=lambda d: d.uid)
def test_every_panel_returns_data(prometheus: Prometheus, dashboard: Dashboard) -> None:
    assert prometheus.panels_without_data(dashboard) == {}


def test_the_variables_list_both_jobs_and_their_pools(prometheus: Prometheus) -> None:
    series = prometheus.query(POOLS.variables_from)
    found = {
        (s["metric"]["namespace"], s["metric"]["rlhfjob"], s["metric"]["pool"]) for s in series
    }
    # Beside the GPU pools, the driver: the rule-based reward runs there.
    assert found == {
        (NAMESPACE, job, pool)
        for job, pools in (("sync-ppo", ("policy", "value")), ("async-ppo", ("policy", "rollout")))
        for pool in (*pools, DRIVER)
    }


def test_only_the_gpu_charts_need_an_exporter_that_cannot_run_here() -> None:
    """They are parsed by Prometheus in test_every_panel_returns_data, not run on data."""
    elsewhere = {c.title for d in (POOLS, TRAINING) for c in d.charts() if c.exporter}
    assert elsewhere == {"GPU utilisation by pool", "GPU memory used by pool"}
    assert all(c.exporter == DCGM for d in (POOLS, TRAINING) for c in d.charts() if c.exporter)
