"""Operator metrics (Prometheus) and the /metrics, /healthz and /readyz endpoints.

Per-job series carry `namespace` and `rlhfjob` (the RLHFJob's name), as the trainer's do
through their scrape labels, so one dashboard variable selects a job in both. Not `job`:
Prometheus uses that for the scrape job (the chart's ServiceMonitor keeps these labels
with honorLabels).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from rlhf_operator.api.job import Phase, RLHFJobStatus

JOBS = Gauge("rlhf_operator_jobs", "RLHFJobs by phase", ["phase"])
RECONCILE_SECONDS = Histogram(
    "rlhf_operator_reconcile_duration_seconds",
    "Time of one reconcile of one job",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_ERRORS = Counter("rlhf_operator_reconcile_errors_total", "Reconciles that failed")
QUEUE_DEPTH = Gauge("rlhf_operator_queue_depth", "Jobs waiting to be reconciled")
POOL_GPUS = Gauge(
    "rlhf_pool_gpus", "GPUs of a job's pool", ["namespace", "rlhfjob", "pool", "state"]
)
RESTARTS = Gauge(
    "rlhf_job_restarts",
    "Attempts started after a failure (status.restarts)",
    ["namespace", "rlhfjob"],
)
DRIVER_RESTARTS = Gauge(
    "rlhf_job_driver_restarts",
    "Ray heads lost and replaced inside an attempt: the driver started again "
    "(status.driverRestarts)",
    ["namespace", "rlhfjob"],
)


class JobGauges:
    """Keeps the per-job series in step with the jobs that exist."""

    def __init__(self) -> None:
        self._phase: dict[tuple[str, str], Phase] = {}
        self._pools: dict[tuple[str, str], list[str]] = {}

    def observe(self, namespace: str, name: str, status: RLHFJobStatus | None) -> None:
        key = (namespace, name)
        for pool in self._pools.pop(key, []):
            for state in ("desired", "ready"):
                POOL_GPUS.remove(namespace, name, pool, state)
        if status is None:
            if self._phase.pop(key, None) is not None:
                RESTARTS.remove(namespace, name)
                DRIVER_RESTARTS.remove(namespace, name)
        else:
            self._phase[key] = status.phase
            RESTARTS.labels(namespace, name).set(status.restarts)
            DRIVER_RESTARTS.labels(namespace, name).set(status.driver_restarts)
            for pool_status in status.pools:
                POOL_GPUS.labels(namespace, name, pool_status.name, "desired").set(
                    pool_status.desired_gpus
                )
                POOL_GPUS.labels(namespace, name, pool_status.name, "ready").set(
                    pool_status.ready_gpus
                )
            self._pools[key] = [p.name for p in status.pools]
        for phase in Phase:
            JOBS.labels(phase.value).set(sum(p is phase for p in self._phase.values()))


Check = Callable[[], Awaitable[bool]]


def health_app(is_alive: Check, is_ready: Check) -> web.Application:
    """/healthz: the operator's workers are alive; /readyz: and it can reach the API."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def probe(check: Check) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(_: web.Request) -> web.Response:
            ok = await check()
            return web.Response(text="ok") if ok else web.Response(status=503, text="not ok")

        return handler

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", probe(is_alive))
    app.router.add_get("/readyz", probe(is_ready))
    return app
