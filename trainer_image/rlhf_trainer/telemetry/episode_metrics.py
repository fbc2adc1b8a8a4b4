"""rlhf_env_*: what multi-turn episodes did, per trained step (generation.multiTurn).

Registered by the first step that has episodes, so a single-turn job exports none of
them. Cut reasons are labels by their kind only (`environment_timeout`, not its message).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.algo.experience import CUT_REASONS

TURN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)
VERSION_SPAN_BUCKETS = (0, 1, 2, 3, 4, 8, 16)
STEP_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class EpisodeSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.episodes = Counter("rlhf_env_episodes", "Episodes trained on, cut or not", registry=r)
        self.cut = Counter(
            "rlhf_env_cut_episodes",
            "Episodes cut by a limit or an environment error (masked: not trained on), by reason",
            ["reason"],
            registry=r,
        )
        for reason in CUT_REASONS:  # each at 0 from the start: a rate of none is no data
            self.cut.labels(reason)
        self.restarts = Counter(
            "rlhf_env_session_restarts",
            "Sessions started again on another replica because theirs died",
            registry=r,
        )
        self.turns = Histogram(
            "rlhf_env_turns", "Assistant turns per episode", buckets=TURN_BUCKETS, registry=r
        )
        self.tool_calls = Histogram(
            "rlhf_env_tool_calls", "Tool calls per episode", buckets=TURN_BUCKETS, registry=r
        )
        self.version_span = Histogram(
            "rlhf_env_version_span",
            "Policy versions between an episode's oldest and newest turn",
            buckets=VERSION_SPAN_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "rlhf_env_step_seconds",
            "Seconds of each step call to the environment (its tool calls, answered)",
            buckets=STEP_SECONDS_BUCKETS,
            registry=r,
        )

    def observe(self, stats: EpisodeStats) -> None:
        for episode in stats.episodes:
            self.turns.observe(episode.turns)
            self.tool_calls.observe(episode.tool_calls)
            self.version_span.observe(episode.version_span)
            for seconds in episode.step_seconds:
                self.step_seconds.observe(seconds)
        self.episodes.inc(len(stats.episodes))
        self.restarts.inc(stats.restarts)
        for reason, count in stats.cuts.items():
            self.cut.labels(reason).inc(count)
