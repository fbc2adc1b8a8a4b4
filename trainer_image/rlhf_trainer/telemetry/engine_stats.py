"""vLLM's own engine metrics, per rollout engine, on the driver's /metrics.

In a rollout worker's process vLLM records its metrics (`vllm:` names) in
prometheus_client's process-global registry. `read_engine_stats` reads the few the
trainer exports into an `EngineStats`: it reads metric values (thread-safe) and never
calls the engine, so it answers at once even while the engine is generating. The
driver polls every engine for them (`cluster.engine_stats`) and `EngineSeries` exports
what each one last reported as rlhf_vllm_*{pool,engine}, at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# vLLM's names (vllm/v1/metrics/loggers.py, PrometheusStatLogger), as samples.
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # a fraction, despite the name
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens_total"
VLLM_SAMPLES = (
    VLLM_RUNNING,
    VLLM_WAITING,
    VLLM_KV_CACHE_USAGE,
    VLLM_GENERATION_TOKENS,
    VLLM_PROMPT_TOKENS,
)


@dataclass(frozen=True)
class EngineStats:
    """One engine's state and cumulative counts, as vLLM's own metrics report them."""

    requests_running: int
    requests_waiting: int
    kv_cache_usage: float  # fraction of the KV cache in use, 0..1
    generation_tokens: int  # since the rollout rank started
    prompt_tokens: int


def engine_stats_of(families: Iterable[Metric]) -> EngineStats | None:
    """The stats in vLLM's metric families; None if any is missing (no engine here).

    A rollout worker runs one engine core (vLLM labels it engine "0"); were there
    several, their counts would add up and the KV usage would be the fullest one's.
    """
    values: dict[str, list[float]] = {}
    for family in families:
        for sample in family.samples:
            values.setdefault(sample.name, []).append(sample.value)
    if any(name not in values for name in VLLM_SAMPLES):
        return None
    return EngineStats(
        requests_running=int(sum(values[VLLM_RUNNING])),
        requests_waiting=int(sum(values[VLLM_WAITING])),
        kv_cache_usage=max(values[VLLM_KV_CACHE_USAGE]),
        generation_tokens=int(sum(values[VLLM_GENERATION_TOKENS])),
        prompt_tokens=int(sum(values[VLLM_PROMPT_TOKENS])),
    )


def read_engine_stats(registry: CollectorRegistry = REGISTRY) -> EngineStats | None:
    """The stats of the vLLM engine in this process, from vLLM's metrics (which need
    its Prometheus stat logger: see `engine.RolloutEngine`)."""
    return engine_stats_of(registry.restricted_registry(VLLM_SAMPLES).collect())


Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
SERIES: tuple[tuple[Family, str, str, Callable[[EngineStats], float]], ...] = (
    (
        GaugeMetricFamily,
        "rlhf_vllm_requests_running",
        "Requests in the rollout engine's running batch (vLLM)",
        lambda s: s.requests_running,
    ),
    (
        GaugeMetricFamily,
        "rlhf_vllm_requests_waiting",
        "Requests waiting in the rollout engine's queue (vLLM)",
        lambda s: s.requests_waiting,
    ),
    (
        GaugeMetricFamily,
        "rlhf_vllm_kv_cache_usage_ratio",
        "Fraction of the rollout engine's KV cache in use, 0 to 1 (vLLM)",
        lambda s: s.kv_cache_usage,
    ),
    (
        CounterMetricFamily,
        "rlhf_vllm_generation_tokens",  # exported with _total
        "Tokens the rollout engine generated since it started (vLLM)",
        lambda s: s.generation_tokens,
    ),
    (
        CounterMetricFamily,
        "rlhf_vllm_prompt_tokens",
        "Prompt tokens the rollout engine prefilled since it started (vLLM)",
        lambda s: s.prompt_tokens,
    ),
)
LABELS = ["pool", "engine"]


class EngineSeries:
    """rlhf_vllm_*{pool,engine}: the stats
    each rollout engine reported last, exported at scrape time, so a scrape never
    waits on an engine. An engine that stops answering keeps its last values; one that
    is gone (`observe(..., None)`) has no series until it reports again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the poller writes, scrapes read
        self._latest: dict[tuple[str, str], EngineStats] = {}

    def observe(self, pool: str, engine: int, stats: EngineStats | None) -> None:
        """What engine `engine` (its rank in the rollout role) of `pool` reported."""
        key = (pool, str(engine))
        with self._lock:
            if stats is None:
                self._latest.pop(key, None)
            else:
                self._latest[key] = stats

    def describe(self) -> Iterable[Metric]:
        return [family(name, doc, labels=LABELS) for family, name, doc, _ in SERIES]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            latest = sorted(self._latest.items())
        for family_type, name, doc, value in SERIES:
            family = family_type(name, doc, labels=LABELS)
            for labels, stats in latest:
                family.add_metric(list(labels), value(stats))
            yield family
