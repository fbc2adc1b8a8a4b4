"""vLLM's engine metrics: read from vLLM's series into EngineStats, exported per engine
as rlhf_vllm_*{pool,engine} on the trainer's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlhf_trainer.telemetry.engine_stats import EngineStats, read_engine_stats
from rlhf_trainer.telemetry.metrics import TrainerMetrics

VLLM_LABELS = ["model_name", "engine"]


def vllm_registry() -> CollectorRegistry:
    """The series as vLLM's PrometheusStatLogger makes them (one engine core), with
    neighbours whose names share a prefix."""
    registry = CollectorRegistry()
    values = {
        "vllm:num_requests_running": 3,
        "vllm:num_requests_waiting": 5,
        "vllm:num_requests_waiting_by_reason": 100,  # not the total: ignored
        "vllm:kv_cache_usage_perc": 0.25,
    }
    for name, value in values.items():
        labels = VLLM_LABELS + (["reason"] if name.endswith("by_reason") else [])
        gauge = Gauge(name, name, labels, registry=registry)
        gauge.labels(*["tiny", "0", "capacity"][: len(labels)]).set(value)
    for name, value in {"vllm:generation_tokens": 640, "vllm:prompt_tokens": 96}.items():
        Counter(name, name, VLLM_LABELS, registry=registry).labels("tiny", "0").inc(value)
    return registry


def test_vllms_series_become_engine_stats() -> None:
    assert read_engine_stats(vllm_registry()) == EngineStats(
        requests_running=3,
        requests_waiting=5,
        kv_cache_usage=0.25,
        generation_tokens=640,
        prompt_tokens=96,
    )


def test_a_process_without_an_engine_has_no_stats() -> None:
    assert read_engine_stats(CollectorRegistry()) is None
    partial = CollectorRegistry()
    Gauge("vllm:num_requests_running", "", registry=partial).set(1)
    assert read_engine_stats(partial) is None


def scraped(metrics: TrainerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every rlhf_vllm_ sample of the registry's text exposition, parsed back."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("rlhf_vllm_")
    }


def test_each_engines_stats_are_exported_with_its_pool_and_rank() -> None:
    metrics = TrainerMetrics(pools=["rollout"])
    assert scraped(metrics) == {}  # no engine has reported yet
    metrics.engines.observe("rollout", 0, EngineStats(2, 0, 0.5, 100, 40))
    metrics.engines.observe("rollout", 1, EngineStats(0, 7, 0.125, 30, 12))
    series = scraped(metrics)
    one = (("engine", "1"), ("pool", "rollout"))
    assert series[("rlhf_vllm_requests_running", one)] == 0
    assert series[("rlhf_vllm_requests_waiting", one)] == 7
    assert series[("rlhf_vllm_kv_cache_usage_ratio", one)] == 0.125
    assert series[("rlhf_vllm_generation_tokens_total", one)] == 30
    assert series[("rlhf_vllm_prompt_tokens_total", one)] == 12
    zero = (("engine", "0"), ("pool", "rollout"))
    assert series[("rlhf_vllm_requests_running", zero)] == 2
    assert series[("rlhf_vllm_generation_tokens_total", zero)] == 100
    assert len(series) == 10  # five series, two engines
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE rlhf_vllm_generation_tokens_total counter" in text.splitlines()


def test_an_engine_that_is_gone_loses_its_series_and_the_others_keep_theirs() -> None:
    metrics = TrainerMetrics(pools=["rollout"])
    metrics.engines.observe("rollout", 0, EngineStats(1, 0, 0.5, 10, 4))
    metrics.engines.observe("rollout", 1, EngineStats(1, 0, 0.5, 20, 4))
    metrics.engines.observe("rollout", 1, None)
    engines = {dict(labels)["engine"] for _, labels in scraped(metrics)}
    assert engines == {"0"}
