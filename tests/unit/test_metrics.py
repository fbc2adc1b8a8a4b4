"""Operator metrics follow the jobs that exist; probes and /metrics are served."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from rlhf_operator.api.job import Phase, PoolStatus, RLHFJobStatus
from rlhf_operator.app.metrics import JobGauges, health_app


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_pool_gpus_and_phases_follow_the_jobs() -> None:
    gauges = JobGauges()
    running = RLHFJobStatus(
        phase=Phase.RUNNING, pools=[PoolStatus(name="p", desired_gpus=8, ready_gpus=4)], restarts=2
    )
    gauges.observe("ns", "metrics-a", running)
    gauges.observe("ns", "metrics-b", RLHFJobStatus(phase=Phase.RUNNING))
    assert (
        sample("rlhf_pool_gpus", namespace="ns", rlhfjob="metrics-a", pool="p", state="desired")
        == 8
    )
    assert (
        sample("rlhf_pool_gpus", namespace="ns", rlhfjob="metrics-a", pool="p", state="ready") == 4
    )
    assert sample("rlhf_operator_jobs", phase="Running") == 2
    assert sample("rlhf_job_restarts", namespace="ns", rlhfjob="metrics-a") == 2
    assert sample("rlhf_job_restarts", namespace="ns", rlhfjob="metrics-b") == 0

    gauges.observe("ns", "metrics-a", None)  # deleted
    assert (
        sample("rlhf_pool_gpus", namespace="ns", rlhfjob="metrics-a", pool="p", state="desired")
        is None
    )
    assert sample("rlhf_operator_jobs", phase="Running") == 1
    assert sample("rlhf_job_restarts", namespace="ns", rlhfjob="metrics-a") is None


def test_probes_and_metrics_endpoint() -> None:
    alive = {"value": True}

    async def is_alive() -> bool:
        return alive["value"]

    async def is_ready() -> bool:
        return alive["value"]

    async def scenario() -> None:
        client = TestClient(TestServer(health_app(is_alive, is_ready)))
        await client.start_server()
        try:
            assert (await client.get("/healthz")).status == 200
            assert (await client.get("/readyz")).status == 200
            body = await (await client.get("/metrics")).text()
            assert "rlhf_operator_reconcile_duration_seconds_bucket" in body
            alive["value"] = False
            assert (await client.get("/healthz")).status == 503
            assert (await client.get("/readyz")).status == 503
        finally:
            await client.close()

    asyncio.run(scenario())


def test_an_unreachable_api_server_is_reported_as_such() -> None:
    from kubernetes import client

    from rlhf_operator.controller.kube import Kube
    from tests.controlplane.processes import free_ports

    port = free_ports(1)[0]  # nothing listens there
    kube = Kube(client.ApiClient(client.Configuration(host=f"https://127.0.0.1:{port}")))
    assert kube.reachable() is False
