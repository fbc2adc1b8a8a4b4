"""The dashboards' generator: the chart ships its output, and every query refers only
to what a dashboard defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from monitoring.charts import Dashboard
from monitoring.dashboards import DASHBOARDS, OPERATOR, POOLS, TRAINING
from monitoring.grafana import to_json
from rlhf_trainer.telemetry.metrics import AgentMetrics

SHIPPED = Path(__file__).parents[2] / "charts" / "rlhf-operator" / "dashboards"
GRAFANA_BUILTINS = {"__rate_interval", "__range"}


def test_the_chart_ships_what_the_generator_makes() -> None:
    assert sorted(p.name for p in SHIPPED.glob("*.json")) == sorted(d.file_name for d in DASHBOARDS)
    for dashboard in DASHBOARDS:
        shipped = (SHIPPED / dashboard.file_name).read_text()
        assert shipped == to_json(dashboard), (
            f"run `make dashboards`: {dashboard.file_name} drifted"
        )


def variables(dashboard: Dashboard) -> list[str]:
    return [v["name"] for v in json.loads(to_json(dashboard))["templating"]["list"]]


def test_each_dashboard_selects_namespace_and_job_and_pool_where_it_has_pools() -> None:
    assert variables(POOLS) == ["datasource", "namespace", "job", "pool"]
    assert variables(OPERATOR) == ["datasource", "namespace", "job", "pool"]
    assert variables(TRAINING) == ["datasource", "namespace", "job"]  # no per-pool series


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda d: d.uid)
def test_queries_use_only_the_dashboards_variables(dashboard: Dashboard) -> None:
    defined = set(variables(dashboard)) | GRAFANA_BUILTINS
    for chart in dashboard.charts():
        assert chart.queries, chart.title
        for query in chart.queries:
            used = set(re.findall(r"\$(\w+)", query.expr)) - {"1"}  # $1: label_replace's group
            assert used <= defined, (chart.title, used - defined)


def test_every_panel_has_a_unique_id_and_a_data_source() -> None:
    for dashboard in DASHBOARDS:
        panels = json.loads(to_json(dashboard))["panels"]
        assert len({p["id"] for p in panels}) == len(panels)
        assert all(p["datasource"]["uid"] == "${datasource}" for p in panels if p["type"] != "row")


def test_the_agent_row_charts_every_agent_series_and_only_those() -> None:
    """A counter added to AgentMetrics without a panel, or a panel naming a series the
    trainer does not export, fails here; test_agent_dashboard runs the row's queries."""
    registry = CollectorRegistry()
    AgentMetrics(registry)
    exported = {f"{family.name}_total" for family in registry.collect()}
    [agents] = [row for row in TRAINING.rows if row.agent]
    charted = {
        name
        for chart in agents.charts
        for query in chart.queries
        for name in re.findall(r"rlhf_\w+", query.expr)
    }
    assert charted == exported
