"""Dashboards as Grafana JSON, built with grafana-foundation-sdk."""

from __future__ import annotations

import itertools
import json

from grafana_foundation_sdk.builders import bargauge, common, prometheus, timeseries
from grafana_foundation_sdk.builders import dashboard as builder
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as models
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    VariableModel,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from monitoring.charts import JOB, Chart, Dashboard, Style, series

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
PANEL_WIDTH = 8  # three panels a row, on Grafana's 24-column grid
PANEL_HEIGHT = 8


def variables(dashboard: Dashboard) -> list[Builder[VariableModel]]:
    """A Prometheus data source, then namespace, job and pool: each narrows the next."""
    source = dashboard.variables_from

    def label_values(name: str, label: str, matchers: str) -> builder.QueryVariable:
        return (
            builder.QueryVariable(name)
            .label(name)
            .datasource(DATASOURCE)
            .query(f"label_values({series(source, matchers)}, {label})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )

    chosen: list[Builder[VariableModel]] = [
        builder.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        label_values("namespace", "namespace", ""),
        label_values("job", "rlhfjob", 'namespace=~"$namespace"'),
    ]
    # No filter that filters nothing: a dashboard without per-pool series has no pool.
    uses_pool = any("$pool" in q.expr for c in dashboard.charts() for q in c.queries)
    return [*chosen, label_values("pool", "pool", JOB)] if uses_pool else chosen


def target(expr: str, legend: str, ref: str, style: Style) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
    if style is Style.BARS:  # one value per bucket over the range, ordered by `le`
        return query.instant().format(PromQueryFormat.HEATMAP)
    return query.range()


def panel(chart: Chart) -> timeseries.Panel | bargauge.Panel:
    built = bargauge.Panel() if chart.style is Style.BARS else timeseries.Panel()
    if isinstance(built, timeseries.Panel):
        legend = common.VizLegendOptions().display_mode(models.LegendDisplayMode.TABLE)
        built.legend(legend.placement(models.LegendPlacement.BOTTOM).show_legend(True))
        if chart.style is Style.STACKED:
            built.stacking(common.StackingConfig().mode(models.StackingMode.NORMAL))
            built.fill_opacity(40)
    description = chart.description
    if chart.exporter is not None:
        description += f" Needs: {chart.exporter}."
    built.title(chart.title).description(description).datasource(DATASOURCE).unit(chart.unit)
    for index, query in enumerate(chart.queries):
        built.with_target(target(query.expr, query.legend, chr(ord("A") + index), chart.style))
    return built.height(PANEL_HEIGHT).span(PANEL_WIDTH)


def build(dashboard: Dashboard) -> builder.Dashboard:
    built = (
        builder.Dashboard(dashboard.title)
        .uid(dashboard.uid)
        .description(dashboard.description)
        .tags(["rlhf-operator"])
        .refresh("30s")
        .time("now-3h", "now")
        .variables(variables(dashboard))
    )
    ids = itertools.count(1)  # Grafana links to a panel by its id
    for row in dashboard.rows:
        built.with_row(builder.Row(row.title).id(next(ids)))
        for chart in row.charts:
            built.with_panel(panel(chart).id(next(ids)))
    return built


def to_json(dashboard: Dashboard) -> str:
    """The dashboard's JSON as the chart ships it (stable: sorted keys, a final newline)."""
    model = build(dashboard).build()
    return json.dumps(json.loads(JSONEncoder().encode(model)), indent=2, sort_keys=True) + "\n"
