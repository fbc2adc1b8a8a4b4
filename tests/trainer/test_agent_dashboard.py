"""The training dashboard's agent row (rlhf_agent_*) on a real Prometheus scraping the
trainer's registry, into which the driver's own count_agent_episodes puts the tallies a
rollout rank hands it after each step. A whole agent run counts through the same function
(test_agent_run.py checks its counts); here the tallies are chosen so that every outcome,
refusal and kind of token the row charts has a value, and that a rate's value is known.

The counts come in two rounds: the first before Prometheus starts, so that every series
exists from its first scrape, the second after two scrapes (events, not timers), so that
its increments fall between the same two scrapes for every series and a rate's value
over them is known.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from monitoring.agentic import AGENTS
from monitoring.dashboards import TRAINING
from rlhf_trainer.loop.run import count_agent_episodes
from rlhf_trainer.rollout.agent_shared import EpisodeTally
from rlhf_trainer.telemetry.metrics import TrainerMetrics, serve_metrics
from tests.conftest import needs
from tests.controlplane.processes import free_ports
from tests.prometheus import BINARY, Prometheus, Target, as_promql

pytestmark = needs(None if BINARY.exists() else "no Prometheus: run make controlplane")

DONE = EpisodeTally(
    None, 2, {}, 20, 4, 1
)  # two calls, one sample left out (past maxSamplesPerEpisode)
CUT_BY_THE_GATEWAY = EpisodeTally("max_calls", 2, {"max_calls": 1}, 12, 2, 0)
AGENT_FAILED = EpisodeTally("agent_error: KeyError: 'key'", 1, {}, 5, 2, 0)


def chart(title: str) -> str:
    [found] = [c for c in AGENTS.charts if c.title == title]
    return as_promql(found.queries[0].expr)


def test_every_agent_panel_shows_an_agent_jobs_counts(tmp_path: Path) -> None:
    metrics = TrainerMetrics()
    [port] = free_ports(1)
    server = serve_metrics(metrics.registry, port, addr="127.0.0.1")
    try:
        count_agent_episodes(metrics, [DONE, CUT_BY_THE_GATEWAY, AGENT_FAILED])
        with Prometheus(tmp_path, [Target(port, {"namespace": "local", "rlhfjob": "a"})]) as p:
            p.wait_for_scrapes(2)
            count_agent_episodes(metrics, [DONE, DONE, CUT_BY_THE_GATEWAY])  # 6 calls
            p.wait_for('rlhf_agent_episodes_total{outcome="done"} == 3')
            assert [r.title for r in TRAINING.rows if r.agent] == ["Agent episodes"]
            assert p.panels_without_data(TRAINING, agent=True) == {}
            outcomes = p.query(chart("Agent episodes by outcome"))
            assert {s["metric"]["outcome"] for s in outcomes} == {
                "done",
                "max_calls",
                "agent_error",
            }
            [per_episode] = p.query(chart("Calls per episode"))
            # The second round's calls over its episodes, whatever rate extrapolates.
            assert float(per_episode["value"][1]) == pytest.approx(6 / 3)
    finally:
        server.shutdown()
        server.server_close()
