"""rlhf_env_*: what multi-turn episodes did, per trained step (generation.multiTurn).

Registered by the first step that has episodes, so a single-turn job exports none of
them. Every series is labelled with the environment the episodes ran in (a job may
declare several, chosen per data row). Cut reasons are labels by their kind only
(`environment_timeout`, not its message).
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Histogram

from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.experience import CUT_REASONS, Episode

TURN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)
VERSION_SPAN_BUCKETS = (0, 1, 2, 3, 4, 8, 16)
STEP_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
ENVIRONMENT = ["environment"]


class EpisodeSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.episodes = Counter(
            "rlhf_env_episodes", "Episodes trained on, cut or not", ENVIRONMENT, registry=r
        )
        self.cut = Counter(
            "rlhf_env_cut_episodes",
            "Episodes cut by a limit or an environment error (masked: not trained on), by reason",
            [*ENVIRONMENT, "reason"],
            registry=r,
        )
        self.restarts = Counter(
            "rlhf_env_session_restarts",
            "Sessions started again on another replica because theirs died",
            ENVIRONMENT,
            registry=r,
        )
        self.turns = Histogram(
            "rlhf_env_turns", "Assistant turns per episode", ENVIRONMENT, buckets=TURN_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.tool_calls = Histogram(
            "rlhf_env_tool_calls", "Tool calls per episode", ENVIRONMENT, buckets=TURN_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.version_span = Histogram(
            "rlhf_env_version_span",
            "Policy versions between an episode's oldest and newest turn",
            ENVIRONMENT,
            buckets=VERSION_SPAN_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "rlhf_env_step_seconds",
            "Seconds of each step call to the environment (its tool calls, answered)",
            ENVIRONMENT,
            buckets=STEP_SECONDS_BUCKETS,
            registry=r,
        )
        self.seen: set[str] = set()

    def observe(self, stats: EpisodeStats) -> None:
        by_environment: dict[str, list[Episode]] = defaultdict(list)
        for episode in stats.episodes:
            by_environment[episode.environment].append(episode)
        for environment, episodes in by_environment.items():
            self._observe(environment, EpisodeStats(tuple(episodes)))

    def _observe(self, environment: str, stats: EpisodeStats) -> None:
        if environment not in self.seen:  # each reason at 0 from the start: a rate of none
            self.seen.add(environment)  # is no data
            for reason in CUT_REASONS:
                self.cut.labels(environment, reason)
        for episode in stats.episodes:
            self.turns.labels(environment).observe(episode.turns)
            self.tool_calls.labels(environment).observe(episode.tool_calls)
            self.version_span.labels(environment).observe(episode.version_span)
            for seconds in episode.step_seconds:
                self.step_seconds.labels(environment).observe(seconds)
        self.episodes.labels(environment).inc(len(stats.episodes))
        self.restarts.labels(environment).inc(stats.restarts)
        for reason, count in stats.cuts.items():
            self.cut.labels(environment, reason).inc(count)
