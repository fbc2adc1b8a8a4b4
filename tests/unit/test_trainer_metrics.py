"""The trainer's metrics: pool busy time is the union of its roles' spans."""

from __future__ import annotations

import itertools
import urllib.request

from hypothesis import given
from hypothesis import strategies as st

from rlhf_trainer.algo.diagnostics import ActorStats, CriticStats, ResponseStats
from rlhf_trainer.api.progress import TrainingProgress
from rlhf_trainer.telemetry.metrics import (
    IntervalUnion,
    TrainerMetrics,
    serve_metrics,
    union_seconds,
)
from rlhf_trainer.telemetry.timeline import Timeline

intervals = st.lists(
    st.tuples(st.integers(0, 50), st.integers(0, 20)).map(lambda p: (p[0], p[0] + p[1])),
    max_size=30,
)

ACTOR = ActorStats(
    policy_loss=-0.25,
    clip_fraction=0.125,
    approx_kl=0.01,
    entropy=2.5,
    importance_capped=0.0,
    grad_norm=1.5,
)


def naive_union_seconds(spans: list[tuple[int, int]]) -> int:
    """Count the unit cells [t, t+1) that some span covers (integer endpoints)."""
    return sum(any(s <= t < e for s, e in spans) for t in range(100))


@given(intervals)
def test_union_seconds_counts_overlaps_once(spans: list[tuple[int, int]]) -> None:
    assert union_seconds(spans) == naive_union_seconds(spans)


@given(intervals)
def test_interval_union_added_in_any_order_matches(spans: list[tuple[int, int]]) -> None:
    union = IntervalUnion()
    for start, end in spans:
        union.add(start, end)
    assert union.seconds == naive_union_seconds(spans)
    merged = union.intervals()
    assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(merged))
    assert union_seconds(merged) == union.seconds


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def value(metrics: TrainerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_colocated_roles_take_turns_so_pool_busy_is_their_union() -> None:
    clock = Clock(0.0)
    metrics = TrainerMetrics(pools=["a", "b", "idle"], clock=clock)
    timeline = Timeline(listeners=[metrics.observe_span], clock=clock)
    timeline.record("a", "actor", "update_actor", 0.0, 4.0)
    timeline.record("a", "ref", "ref_log_prob", 3.0, 5.0)  # overlaps the actor by 1 s
    timeline.record("b", "critic", "update_critic", 1.0, 3.0)
    clock.now = 10.0

    assert value(metrics, "rlhf_role_busy_seconds_total", pool="a", role="actor") == 4.0
    assert value(metrics, "rlhf_role_busy_seconds_total", pool="a", role="ref") == 2.0
    assert value(metrics, "rlhf_pool_busy_ratio", pool="a") == 0.5  # 5 s of 10, not 6
    assert value(metrics, "rlhf_pool_busy_ratio", pool="b") == 0.2
    assert value(metrics, "rlhf_pool_busy_ratio", pool="idle") == 0.0
    assert value(metrics, "rlhf_pool_idle_ratio", pool="a") == 0.5
    assert value(metrics, "rlhf_pool_idle_ratio", pool="idle") == 1.0
    assert value(metrics, "rlhf_step_phase_seconds_count", phase="update_actor") == 1
    assert value(metrics, "rlhf_step_phase_seconds_sum", phase="ref_log_prob") == 2.0

    clock.now = 20.0  # computed at scrape time: an idle pool's ratio falls
    assert value(metrics, "rlhf_pool_busy_ratio", pool="a") == 0.25


def test_time_before_the_start_and_clock_skew_do_not_push_the_ratio_past_one() -> None:
    clock = Clock(100.0)
    metrics = TrainerMetrics(clock=clock)
    metrics.observe_span(Timeline(clock=clock).record("a", "actor", "p", 90.0, 112.0))
    clock.now = 110.0
    assert metrics.pool_busy_ratios() == {"a": 1.0}


def test_every_series_is_exported_and_served() -> None:
    metrics = TrainerMetrics(pools=["a"])
    metrics.tokens_generated.inc(128)
    metrics.samples_trained.inc(8)
    metrics.sample_staleness.observe(1)
    metrics.queue_depth.set(3)
    metrics.weight_sync_seconds.observe(0.4)
    metrics.kl.set(0.02)
    metrics.observe_progress(TrainingProgress(step=3, policy_version=3, reward_mean=0.5))
    metrics.observe_diagnostics(
        ACTOR,
        CriticStats(
            value_loss=0.75, value_clip_fraction=0.5, grad_norm=4.0, explained_variance=0.25
        ),
        ResponseStats(length_mean=12.5, length_max=32, truncated_ratio=0.125),
    )
    server = serve_metrics(metrics.registry, port=0, addr="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    for line in [
        "rlhf_tokens_generated_total 128.0",
        "rlhf_samples_trained_total 8.0",
        'rlhf_sample_staleness_bucket{le="1.0"} 1.0',
        "rlhf_queue_depth 3.0",
        "rlhf_weight_sync_seconds_count 1.0",
        "rlhf_policy_version 3.0",
        "rlhf_reward_mean 0.5",
        "rlhf_kl 0.02",
        'rlhf_pool_busy_ratio{pool="a"} 0.0',
        "rlhf_actor_policy_loss -0.25",
        "rlhf_actor_clip_fraction 0.125",
        "rlhf_actor_approx_kl 0.01",
        "rlhf_actor_entropy 2.5",
        "rlhf_actor_importance_capped 0.0",
        "rlhf_actor_grad_norm 1.5",  # the actor's and the critic's are separate series
        "rlhf_critic_grad_norm 4.0",
        "rlhf_critic_value_loss 0.75",
        "rlhf_critic_value_clip_fraction 0.5",
        "rlhf_critic_explained_variance 0.25",
        "rlhf_response_length_mean 12.5",
        "rlhf_response_length_max 32.0",
        "rlhf_response_truncated_ratio 0.125",
    ]:
        assert line in text.splitlines(), line


def test_each_trainer_has_its_own_registry() -> None:
    first, second = TrainerMetrics(), TrainerMetrics()  # no duplicate-series error
    first.tokens_generated.inc(5)
    assert value(second, "rlhf_tokens_generated_total") == 0.0


def test_a_critic_free_job_exports_no_critic_series() -> None:
    metrics = TrainerMetrics(pools=["policy"])
    metrics.observe_diagnostics(ACTOR, None, ResponseStats(4.0, 8, 0.0))
    names = {m.name for m in metrics.registry.collect()}
    assert "rlhf_actor_grad_norm" in names
    assert not any(name.startswith("rlhf_critic_") for name in names), names


def test_episodes_are_counted_by_turns_calls_cuts_restarts_and_environment_seconds() -> None:
    from rlhf_trainer.algo.diagnostics import EpisodeStats
    from rlhf_trainer.algo.experience import Episode, EpisodePhase

    metrics = TrainerMetrics(pools=["policy"])
    assert not any(m.name.startswith("rlhf_env_") for m in metrics.registry.collect())
    turns = [("turn", 1, 0.6), ("step", 1, 0.02), ("turn", 2, 0.6), ("step", 2, 0.3),
             ("turn", 3, 0.6), ("step", 3, 0.004), ("score", 3, 0.1)]  # fmt: skip
    phases = tuple(EpisodePhase(kind, turn, 5.0, 5.0 + s) for kind, turn, s in turns)  # type: ignore[arg-type]
    lookup, calc = {"environment": "lookup"}, {"environment": "calc"}  # each its own series
    episodes = (
        Episode(1.0, turns=3, tool_calls=2, version_span=0, phases=phases, environment="lookup"),
        Episode(0.0, turns=1, tool_calls=0, version_span=1, cut="turn_timeout", restarts=2,
                environment="lookup"),
        Episode(0.0, turns=2, tool_calls=1, version_span=0, cut="environment_error: HTTP 500 ...",
                environment="lookup"),
        Episode(0.0, turns=1, tool_calls=1, version_span=0, cut="environment_timeout: no answer",
                environment="calc"),
    )  # fmt: skip
    metrics.observe_episodes(EpisodeStats(episodes))
    assert value(metrics, "rlhf_env_episodes_total", **lookup) == 3
    assert value(metrics, "rlhf_env_episodes_total", **calc) == 1
    assert value(metrics, "rlhf_env_session_restarts_total", **lookup) == 2
    assert value(metrics, "rlhf_env_cut_episodes_total", reason="turn_timeout", **lookup) == 1
    assert value(metrics, "rlhf_env_cut_episodes_total", reason="environment_error", **lookup) == 1
    assert value(metrics, "rlhf_env_cut_episodes_total", reason="environment_timeout", **calc) == 1
    for environment in (lookup, calc):
        reason = "environment_unreachable"
        assert value(metrics, "rlhf_env_cut_episodes_total", reason=reason, **environment) == 0
    assert value(metrics, "rlhf_env_turns_sum", **lookup) == 6
    assert value(metrics, "rlhf_env_turns_sum", **calc) == 1
    assert value(metrics, "rlhf_env_turns_bucket", le="2.0", **lookup) == 2
    assert value(metrics, "rlhf_env_tool_calls_sum", **lookup) == 3
    assert value(metrics, "rlhf_env_version_span_bucket", le="0.0", **lookup) == 2
    assert value(metrics, "rlhf_env_step_seconds_count", **lookup) == 3
    assert value(metrics, "rlhf_env_step_seconds_bucket", le="0.01", **lookup) == 1
