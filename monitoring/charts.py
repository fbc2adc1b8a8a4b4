"""A dashboard as typed data: rows of charts, each chart a few PromQL queries.

The queries use Grafana's variables: `$namespace`, `$job` and `$pool` (chosen at the
top of every dashboard) and `$__rate_interval` (Grafana's window for `rate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# Every per-job series, filtered by the dashboard's variables.
JOB = 'namespace=~"$namespace", rlhfjob=~"$job"'
POOL = f'{JOB}, pool=~"$pool"'


class Style(StrEnum):
    LINES = "lines"
    STACKED = "stacked"  # parts of a whole: phases of a step
    BARS = "bars"  # a distribution over the dashboard's range (one value per bucket)


@dataclass(frozen=True)
class Query:
    expr: str  # PromQL with the dashboard's variables
    legend: str  # Grafana's legend format, e.g. "{{pool}}"


@dataclass(frozen=True)
class Chart:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"  # a Grafana unit: percentunit, s, ops...
    style: Style = Style.LINES
    # A series from an exporter outside rlhf-operator (e.g. NVIDIA's DCGM exporter):
    # where it runs, the chart works; the tests here can check only its syntax.
    exporter: str | None = None


@dataclass(frozen=True)
class Row:
    title: str
    charts: tuple[Chart, ...]
    # Series only a multi-turn job exports (generation.multiTurn): its panels are empty
    # for any other job, and the tests check them on a multi-turn run.
    multi_turn: bool = False
    # Series only an agent job exports (generation.agent), tested on an agent's counts.
    agent: bool = False


@dataclass(frozen=True)
class Dashboard:
    uid: str  # stable: links and provisioning find the dashboard by it
    title: str
    description: str
    # The series whose labels fill the namespace, job and pool variables.
    variables_from: str
    rows: tuple[Row, ...]

    @property
    def file_name(self) -> str:
        return f"{self.uid}.json"

    def charts(self) -> list[Chart]:
        return [chart for row in self.rows for chart in row.charts]


def chart(
    title: str,
    description: str,
    *queries: tuple[str, str],
    unit: str = "short",
    style: Style = Style.LINES,
    exporter: str | None = None,
) -> Chart:
    """A chart of (expr, legend) queries: the dashboards read as a list of these."""
    return Chart(
        title, description, tuple(Query(e, legend) for e, legend in queries), unit, style, exporter
    )


def series(name: str, labels: str = JOB) -> str:
    """A series selector: the name, filtered by the labels."""
    return f"{name}{{{labels}}}" if labels else name


def rate(counter: str, labels: str = JOB, by: str = "rlhfjob") -> str:
    """Per second, summed by `by`, over Grafana's rate window."""
    return f"sum by ({by}) (rate({series(counter, labels)}[$__rate_interval]))"


def quantile(q: float, histogram: str, labels: str = JOB, by: str = "rlhfjob") -> str:
    """The q-quantile of a Prometheus histogram over Grafana's rate window."""
    buckets = f"rate({series(histogram + '_bucket', labels)}[$__rate_interval])"
    grouping = ", ".join(label for label in ("le", by) if label)
    return f"histogram_quantile({q}, sum by ({grouping}) ({buckets}))"


def step_gauges(*gauges: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """Last-step gauges, one query each, with the job in the legend."""
    return tuple((series(name), f"{{{{rlhfjob}}}} {legend}") for name, legend in gauges)
