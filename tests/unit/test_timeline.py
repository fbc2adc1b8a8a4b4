"""The timeline records spans from any thread and writes a valid Chrome trace."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from rlhf_trainer.algo.experience import Episode, EpisodePhase
from rlhf_trainer.telemetry.timeline import Lanes, Span, Timeline


def ticking_clock(step: float = 1.0) -> Any:
    """A clock that advances `step` seconds at each reading, from 100."""
    counter = itertools.count()
    return lambda: 100.0 + step * next(counter)


def test_span_times_the_block_and_tells_the_listeners_even_when_it_raises() -> None:
    seen: list[Span] = []
    timeline = Timeline(listeners=[seen.append], clock=ticking_clock())
    with timeline.span("a", "actor", "update_actor"):
        pass
    with pytest.raises(RuntimeError), timeline.span("b", "critic", "values"):
        raise RuntimeError("boom")
    assert seen == [
        Span("a", "actor", "update_actor", 101.0, 102.0),
        Span("b", "critic", "values", 103.0, 104.0),
    ]
    assert timeline.spans() == tuple(seen)


def test_spans_timed_by_workers_are_recorded_and_bad_ones_refused() -> None:
    timeline = Timeline(clock=ticking_clock())
    timeline.record("a", "rollout", "generate", 5.0, 7.5)
    assert timeline.spans()[0].seconds == 2.5
    with pytest.raises(ValueError, match="ends before it starts"):
        timeline.record("a", "rollout", "generate", 7.0, 6.0)


def test_many_threads_lose_no_span() -> None:
    timeline = Timeline()

    def work(role: str) -> None:
        for _ in range(200):
            with timeline.span("pool", role, "phase"):
                pass

    threads = [threading.Thread(target=work, args=(f"r{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(timeline.spans()) == 800


def test_only_the_newest_spans_are_kept_for_the_trace() -> None:
    seen: list[Span] = []
    timeline = Timeline(listeners=[seen.append], keep=2)
    for start in range(5):
        timeline.record("a", "actor", "p", start, start + 1)
    assert [s.start for s in timeline.spans()] == [3, 4]
    assert len(seen) == 5  # the metrics still see every span


def test_chrome_trace_is_valid_and_shows_two_pools_working_at_once(tmp_path: Path) -> None:
    timeline = Timeline(clock=lambda: 1000.0)
    # Split placement: the actor update on pool a overlaps the critic update on pool b;
    # pool a's colocated ref runs after its actor.
    timeline.record("a", "actor", "update_actor", 1001.0, 1003.0)
    timeline.record("b", "critic", "update_critic", 1001.5, 1002.5)
    timeline.record("a", "ref", "ref_log_prob", 1003.0, 1003.25)
    path = tmp_path / "trace.json"
    timeline.write_chrome_trace(path)
    trace = json.loads(path.read_text())

    events = trace["traceEvents"]
    for event in events:  # the fields every trace-event viewer needs
        assert event["ph"] in {"X", "M"}
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert isinstance(event["name"], str)
    names = {(e["name"], e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    pool = {pid: name for (kind, pid, _), name in names.items() if kind == "process_name"}
    role = {(pid, tid): n for (kind, pid, tid), n in names.items() if kind == "thread_name"}
    assert sorted(pool.values()) == ["a", "b"]

    complete = {e["name"]: e for e in events if e["ph"] == "X"}
    for event in complete.values():
        assert isinstance(event["ts"], float | int) and event["dur"] >= 0
    actor, critic, ref = (complete[p] for p in ("update_actor", "update_critic", "ref_log_prob"))
    assert (pool[actor["pid"]], role[actor["pid"], actor["tid"]]) == ("a", "actor")
    assert (pool[critic["pid"]], role[critic["pid"], critic["tid"]]) == ("b", "critic")
    assert actor["pid"] == ref["pid"] and actor["tid"] != ref["tid"]
    assert (actor["ts"], actor["dur"]) == (1_000_000, 2_000_000)  # µs since the start

    def overlap(x: dict[str, Any], y: dict[str, Any]) -> bool:
        return x["ts"] < y["ts"] + y["dur"] and y["ts"] < x["ts"] + x["dur"]

    assert overlap(actor, critic)  # the two pools ran at the same time
    assert not overlap(actor, ref)  # colocated roles took turns
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary left


def episode(start: float, turns: int, tool_calls: int = 1) -> Episode:
    """An episode that starts its session at `start`, then takes a second per turn and
    per step, and ends with its score."""
    at = itertools.count(start)
    phases = [EpisodePhase("start", 0, next(at), start + 0.5)]
    for turn in range(1, turns + 1):
        phases.append(EpisodePhase("turn", turn, t := next(at), t + 1))
        phases.append(EpisodePhase("step", turn, t := next(at), t + 1, tool_calls))
    phases.append(EpisodePhase("score", turns, t := next(at), t + 0.5))
    return Episode(1.0, turns, turns * tool_calls, 0, phases=tuple(phases))


def test_episodes_go_on_the_trace_in_lanes_that_never_overlap_and_nowhere_else(
    tmp_path: Path,
) -> None:
    seen: list[Span] = []
    timeline = Timeline(listeners=[seen.append], clock=lambda: 1000.0)
    # Three at once, then one that starts as the first ends: the first lane again.
    first, second, third = episode(1000, 2), episode(1000.5, 1), episode(1001, 3, tool_calls=2)
    timeline.add_episodes("rollout", [first, second, third])
    timeline.add_episodes("rollout", [episode(first.phases[-1].end, 1)])
    assert (seen, timeline.spans()) == ([], ())  # no listener, no busy time: trace only
    timeline.write_chrome_trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]

    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    by_lane: dict[str, list[dict[str, Any]]] = {}
    for event in (e for e in events if e["ph"] == "X"):
        by_lane.setdefault(lanes[event["tid"]], []).append(event)
    assert sorted(by_lane) == ["episodes 1", "episodes 2", "episodes 3"]
    assert [e["name"] for e in by_lane["episodes 3"]] == [
        "environment start", "turn 1", "tools 1 (2 calls)", "turn 2", "tools 2 (2 calls)",
        "turn 3", "tools 3 (2 calls)", "environment score",
    ]  # fmt: skip
    assert [e["name"] for e in by_lane["episodes 2"]][2] == "tools 1 (1 call)"
    assert len(by_lane["episodes 1"]) == len(first.phases) + 4  # the fourth joined it
    for spans in by_lane.values():
        ordered = sorted(spans, key=lambda e: e["ts"])
        for before, after in itertools.pairwise(ordered):
            assert before["ts"] + before["dur"] <= after["ts"]


def test_lanes_reuse_the_first_free_lane_per_pool() -> None:
    lanes = Lanes()
    assert [lanes.take("a", 0, 10), lanes.take("a", 5, 6), lanes.take("a", 6, 7)] == [1, 2, 2]
    assert lanes.take("a", 1, 2) == 3  # lane 1 runs to 10, lane 2 to 7: neither is free at 1
    assert lanes.take("b", 0, 1) == 1  # another pool's lanes are its own
    assert lanes.take("a", 10, 11) == 1
