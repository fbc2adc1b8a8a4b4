"""Every panel of the pools and training dashboards, run against a real Prometheus
that scraped two real local runs: PPO split (synchronous) and PPO fully async. The
fully-async run, at stalenessThreshold 1, also shows its generation overlapping scoring.

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
from tests.controlplane.processes import free_ports
from tests.prometheus import BINARY, Prometheus, Target
from tests.specs import local_async_job, local_job
from tests.trainer.local_runs import Trained, train

pytestmark = [
    pytest.mark.slow,  # two short runs
    needs(None if BINARY.exists() else "no Prometheus: run make controlplane"),
]

STEPS = 3
ASYNC_STEPS = 8  # enough scoring spans to count the overlapped ones
NAMESPACE = "local"  # what a PodMonitor would add as the pod's namespace


def jobs(tmp: Path) -> dict[str, JobConfig]:
    fully_async = local_async_job(
        staleness=1, total_steps=ASYNC_STEPS, checkpoint_dir=tmp / "async", every_steps=100
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
def runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Prometheus, dict[str, Trained]]]:
    """Prometheus, once it has scraped both runs' last values, and the runs."""
    tmp = tmp_path_factory.mktemp("dashboards")
    configs = jobs(tmp)
    ports = dict(zip(configs, free_ports(len(configs)), strict=True))
    targets = [Target(ports[name], {"namespace": NAMESPACE, "rlhfjob": name}) for name in configs]
    servers, trained = [], {}
    with Prometheus(tmp, targets) as prometheus:
        try:
            for name, config in configs.items():
                metrics = TrainerMetrics(pools=[p.name for p in config.pools])
                servers.append(serve_metrics(metrics.registry, ports[name], addr="127.0.0.1"))
                trained[name] = train(config, metrics)
                samples = config.trainer.total_steps * config.samples_per_step
                prometheus.wait_for(f'rlhf_samples_trained_total{{rlhfjob="{name}"}} == {samples}')
            yield prometheus, trained
        finally:
            for server in servers:
                server.shutdown()
                server.server_close()


@pytest.fixture(scope="module")
def prometheus(runs: tuple[Prometheus, dict[str, Trained]]) -> Prometheus:
    return runs[0]


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


def test_with_a_batch_queued_ahead_generation_overlaps_most_scoring(
    runs: tuple[Prometheus, dict[str, Trained]],
) -> None:
    """With stalenessThreshold 1 the queue holds the next batch when a step starts, and
    the engines generate the one after it while the trainer scores: most scoring spans
    overlap generation (measured 19 of 20, 94% of their time). With 0.5
    (test_async_loop's `stale` run) the half batch a step waits for comes with the rest
    of its engine batch, so few do (14 of 60), and with 0 none can."""
    trained = runs[1]["async-ppo"]
    events = [e for e in trained.trace["traceEvents"] if e["ph"] == "X"]
    generating = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "generate"]
    scoring = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "actor_log_prob"]
    assert len(scoring) == ASYNC_STEPS
    overlapped = [s for s in scoring if any(g[0] < s[1] and s[0] < g[1] for g in generating)]
    assert len(overlapped) >= 6, f"{len(overlapped)} of {len(scoring)} scoring spans overlap"
    registry = trained.metrics.registry
    for pool in ("policy", "rollout"):
        idle = registry.get_sample_value("rlhf_pool_idle_ratio", {"pool": pool})
        assert idle is not None and 0 <= idle < 1
