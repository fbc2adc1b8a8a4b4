"""The trainer's Prometheus metrics: how busy each pool is, and how training goes.

Each trainer owns a `TrainerMetrics` with its own registry (not the process-global
one), so two trainers in one process, or two tests, never share series. Wire it to
the timeline so every span counts:

    metrics = TrainerMetrics(pools=[p.name for p in plan.pools])
    timeline = Timeline(listeners=[metrics.observe_span])
    serve_metrics(metrics.registry, port=8080)

A pool's busy ratio is the time any of its roles was running over the wall time since
the trainer started. Colocated roles take turns on the same GPUs, and a role timed by
several threads may overlap itself, so a pool's busy time is the length of the union
of its spans, not their sum (which could exceed the wall time).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, fields
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from rlhf_trainer.algo.diagnostics import ActorStats, CriticStats, EpisodeStats, ResponseStats
from rlhf_trainer.api.progress import EvalProgress, TrainingProgress
from rlhf_trainer.telemetry.engine_stats import EngineSeries
from rlhf_trainer.telemetry.episode_metrics import EpisodeSeries
from rlhf_trainer.telemetry.timeline import Span

Interval = tuple[float, float]  # (start, end) in seconds

# A phase takes from milliseconds (a rule-based reward) to minutes (a big update).
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Policy versions between the one that generated a sample and the one trained on it.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
WEIGHT_SYNC_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def union_seconds(intervals: Iterable[Interval]) -> float:
    """Total length covered by the intervals, counting overlaps once."""
    total = 0.0
    covered_to = float("-inf")
    for start, end in sorted(intervals):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


class IntervalUnion:
    """The union of intervals added one at a time, kept as sorted disjoint intervals.

    Spans close out of order (a long update ends after a short reward that started
    later), so each one is merged where it belongs rather than appended.
    """

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []  # sorted too, since the intervals are disjoint
        self.seconds = 0.0

    def add(self, start: float, end: float) -> None:
        if end <= start:
            return
        first = bisect_left(self._ends, start)  # first interval ending at or after start
        past = bisect_right(self._starts, end)  # first interval starting after end
        if first < past:  # these overlap or touch the new one: merge them into it
            start = min(start, self._starts[first])
            end = max(end, self._ends[past - 1])
            self.seconds -= sum(
                e - s for s, e in zip(self._starts[first:past], self._ends[first:past], strict=True)
            )
        self._starts[first:past] = [start]
        self._ends[first:past] = [end]
        self.seconds += end - start

    def intervals(self) -> list[Interval]:
        return list(zip(self._starts, self._ends, strict=True))


DIAGNOSTICS: tuple[tuple[str, type[Any], str], ...] = (
    ("actor", ActorStats, "The actor's update"),
    ("critic", CriticStats, "The critic's update"),
    ("response", ResponseStats, "The batch's responses"),
)


def diagnostic_gauges(registry: CollectorRegistry, prefix: str) -> dict[str, Gauge]:
    """rlhf_<prefix>_*: a gauge per field of the role's step stats (DIAGNOSTICS)."""
    stats, doc = next((t, d) for p, t, d in DIAGNOSTICS if p == prefix)
    return {
        f.name: Gauge(f"rlhf_{prefix}_{f.name}", f"{doc}: {f.name} (last step)", registry=registry)
        for f in fields(stats)
    }


class AgentMetrics:
    """rlhf_agent_*: what the agents' gateway served and refused, counted by the driver
    from each episode's records as it is closed (gateway.records.EpisodeRecords)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.episodes = Counter(
            "rlhf_agent_episodes",
            "Agent episodes closed, by how they ended: done, or the cut's reason (a limit, "
            "an agent that failed or ran past its deadline)",
            ["outcome"],
            registry=r,
        )
        self.calls = Counter(
            "rlhf_agent_calls", "Chat completions the gateway served to agents", registry=r
        )
        self.refusals = Counter(
            "rlhf_agent_refusals",
            "Agents' calls the gateway refused, by reason (max_calls, max_call_tokens, "
            "episode_timeout)",
            ["reason"],
            registry=r,
        )
        self.tokens = Counter(
            "rlhf_agent_tokens",
            "Tokens of the agents' calls: prompt (rendered by the gateway) or sampled",
            ["kind"],
            registry=r,
        )
        self.samples_left_out = Counter(
            "rlhf_agent_samples_left_out",
            "Samples of agent episodes not trained on: those past "
            "generation.agent.maxSamplesPerEpisode (the earliest), and a masked cut "
            "episode's others",
            registry=r,
        )

    def count_episode(
        self,
        cut: str | None,
        calls: int,
        refusals: dict[str, int],
        prompt_tokens: int,
        sampled_tokens: int,
    ) -> None:
        """One closed episode: `cut` its reason (None: it ended as the agent said)."""
        self.episodes.labels(cut.split(":")[0] if cut else "done").inc()
        self.calls.inc(calls)
        for reason, count in refusals.items():
            self.refusals.labels(reason).inc(count)
        self.tokens.labels("prompt").inc(prompt_tokens)
        self.tokens.labels("sampled").inc(sampled_tokens)


class TrainerMetrics:
    """Every `rlhf_` series the trainer exports, in a registry of its own.

    Counters and histograms are public attributes for the loop to update directly
    (`metrics.tokens_generated.inc(n)`); busy time comes from `observe_span`.
    """

    def __init__(self, pools: Iterable[str] = (), clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        self._clock = clock
        self.started = clock()
        self._lock = threading.Lock()  # spans arrive on many threads; scrapes on another
        self._pool_busy: dict[str, IntervalUnion] = {pool: IntervalUnion() for pool in pools}

        r = self.registry
        self.role_busy_seconds = Counter(
            "rlhf_role_busy_seconds",
            "Seconds each role spent running phases, by pool and role",
            ["pool", "role"],
            registry=r,
        )
        self.step_phase_seconds = Histogram(
            "rlhf_step_phase_seconds",
            "Duration of each phase of a PPO step",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.tokens_generated = Counter(
            "rlhf_tokens_generated", "Response tokens generated by the rollout", registry=r
        )
        self.samples_trained = Counter(
            "rlhf_samples_trained", "Samples the actor was updated on", registry=r
        )
        self.dropped_groups = Counter(
            "rlhf_dropped_groups",
            "Groups dynamic sampling dropped (all rewards equal) and generated again",
            registry=r,
        )
        self.unscored_samples = Counter(
            "rlhf_reward_unscored_samples",
            "Samples the reward service failed to score after its retries (not trained on)",
            registry=r,
        )
        self._add_streaming_series(r)
        self.policy_version = Gauge(
            "rlhf_policy_version", "Version of the policy being trained", registry=r
        )
        self.reward_mean = Gauge("rlhf_reward_mean", "Mean reward of the last step", registry=r)
        self.kl = Gauge("rlhf_kl", "Mean KL to the reference policy in the last step", registry=r)
        self.kl_coef = Gauge(
            "rlhf_kl_coef", "The KL penalty's coefficient the last step used", registry=r
        )
        # Registered at the first step that reports them: a critic-free job exports no
        # rlhf_critic_* at all (a gauge stuck at 0 would read as a real value).
        self.diagnostics: dict[str, dict[str, Gauge]] = {}
        self.eval_gauges: dict[str, Gauge] = {}  # rlhf_eval_*, likewise
        self.episodes: EpisodeSeries | None = None  # rlhf_env_*, likewise
        r.register(_PoolBusyRatio(self))
        # rlhf_vllm_*{pool,engine}: vLLM's own metrics, as each rollout engine reports
        # them to the driver (cluster.engine_stats).
        self.engines = EngineSeries()
        r.register(self.engines)
        self.agents = AgentMetrics(r)  # rlhf_agent_*: generation.agent's episodes

    def _add_streaming_series(self, r: CollectorRegistry) -> None:
        """What fully-async runs watch: staleness, the queue, weight syncs."""
        self.sample_staleness = Histogram(
            "rlhf_sample_staleness",
            "Policy versions between generating a sample and training on it",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "rlhf_queue_depth",
            "Finished samples waiting for the trainer as a step starts (fully async)",
            registry=r,
        )
        self.rollout_engines = Gauge(
            "rlhf_rollout_engines",
            "Rollout engines by state: serving, lost (its vLLM engine died, or its pod "
            "or node is gone: replaced in its bundle), or joining (fully async)",
            ["pool", "state"],
            registry=r,
        )
        self.samples_readmitted = Counter(
            "rlhf_samples_readmitted",
            "Samples generated again on another engine: their engine was lost before it "
            "delivered them (fully async)",
            registry=r,
        )
        self.weight_sync_seconds = Histogram(
            "rlhf_weight_sync_seconds",
            "Seconds the trainer spends on a weight sync to the rollout engines",
            buckets=WEIGHT_SYNC_BUCKETS,
            registry=r,
        )
        self.weight_sync_failures = Counter(
            "rlhf_weight_sync_failures",
            "Weight syncs to the rollout engines that failed, by the phase they failed in "
            "(init, start, bucket, finish; other): an engine lost, or past the phase's deadline",
            ["phase"],
            registry=r,
        )
        self.weight_sync_last_failure = Gauge(
            "rlhf_weight_sync_last_failure_timestamp_seconds",
            "When the last weight sync that failed failed (Unix time)",
            registry=r,
        )

    def observe_span(self, span: Span) -> None:
        """A Timeline listener: count the span's time for its role and pool."""
        self.role_busy_seconds.labels(span.pool, span.role).inc(span.seconds)
        self.step_phase_seconds.labels(span.phase).observe(span.seconds)
        with self._lock:
            busy = self._pool_busy.setdefault(span.pool, IntervalUnion())
            # Only time since the trainer started counts towards the ratio.
            busy.add(max(span.start, self.started), span.end)

    def observe_engines(self, pool: str, serving: int, lost: int, joining: int = 0) -> None:
        """rlhf_rollout_engines of `pool`: those serving, lost (in the run) and joining."""
        for state, count in (("serving", serving), ("lost", lost), ("joining", joining)):
            self.rollout_engines.labels(pool, state).set(count)

    def observe_sync_failure(self, phase: str) -> None:
        """rlhf_weight_sync_failures_total{phase} and the last failure's time."""
        self.weight_sync_failures.labels(phase).inc()
        self.weight_sync_last_failure.set_to_current_time()

    def observe_progress(self, progress: TrainingProgress) -> None:
        self.policy_version.set(progress.policy_version)
        if progress.reward_mean is not None:
            self.reward_mean.set(progress.reward_mean)

    def observe_eval(self, evaluation: EvalProgress) -> None:
        """rlhf_eval_<field>: the last evaluation on the held-out prompts."""
        for name, value in evaluation.model_dump().items():
            if value is None:  # pass_at_k with one response per prompt
                continue
            gauge = self.eval_gauges.get(name)
            if gauge is None:
                doc = EvalProgress.model_fields[name].description
                gauge = Gauge(
                    f"rlhf_eval_{name}", f"Held-out evaluation: {doc}", registry=self.registry
                )
                self.eval_gauges[name] = gauge
            gauge.set(value)

    def observe_diagnostics(
        self, actor: ActorStats, critic: CriticStats | None, responses: ResponseStats
    ) -> None:
        """Set each role's gauges (a critic-free job never registers rlhf_critic_*)."""
        for prefix, stats in (("actor", actor), ("critic", critic), ("response", responses)):
            if stats is None:
                continue
            if prefix not in self.diagnostics:
                self.diagnostics[prefix] = diagnostic_gauges(self.registry, prefix)
            for name, value in asdict(stats).items():
                self.diagnostics[prefix][name].set(value)

    def observe_episodes(self, stats: EpisodeStats) -> None:
        """rlhf_env_*: a step's multi-turn episodes."""
        if self.episodes is None:
            self.episodes = EpisodeSeries(self.registry)
        self.episodes.observe(stats)

    def pool_busy_ratios(self) -> dict[str, float]:
        """Per pool: busy time over wall time since the trainer started, in [0, 1]."""
        wall = self._clock() - self.started
        with self._lock:
            busy = {pool: union.seconds for pool, union in self._pool_busy.items()}
        # A span reported by a worker whose clock runs ahead may end "in the future".
        return {
            pool: min(1.0, seconds / wall) if wall > 0 else 0.0 for pool, seconds in busy.items()
        }


class _PoolBusyRatio:
    """rlhf_pool_busy_ratio and its complement rlhf_pool_idle_ratio (what a fully-async
    run watches for its rollouter and trainer pools), computed at scrape time so an
    idle pool's ratio falls."""

    NAME = "rlhf_pool_busy_ratio"
    HELP = "Fraction of wall time since the trainer started that any role of the pool was busy"
    IDLE_NAME = "rlhf_pool_idle_ratio"
    IDLE_HELP = "Fraction of wall time since the trainer started that the pool was idle"

    def __init__(self, metrics: TrainerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return [
            GaugeMetricFamily(self.NAME, self.HELP, labels=["pool"]),
            GaugeMetricFamily(self.IDLE_NAME, self.IDLE_HELP, labels=["pool"]),
        ]

    def collect(self) -> Iterator[Metric]:
        busy = GaugeMetricFamily(self.NAME, self.HELP, labels=["pool"])
        idle = GaugeMetricFamily(self.IDLE_NAME, self.IDLE_HELP, labels=["pool"])
        for pool, ratio in sorted(self._metrics.pool_busy_ratios().items()):
            busy.add_metric([pool], ratio)
            idle.add_metric([pool], 1.0 - ratio)
        yield busy
        yield idle


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve the registry over HTTP on a daemon thread; port 0 picks a free port.

    The port in use is `server.server_port`; `server.shutdown()` then
    `server.server_close()` stop it.
    """
    server, _thread = start_http_server(port, addr, registry=registry)
    return server
