"""The Grafana dashboards of rlhf-operator, generated from code.

`charts` describes every panel as typed data (a title, PromQL queries, a unit);
`dashboards` lists the three dashboards (pools, training, operator); `grafana` turns
them into Grafana's JSON with grafana-foundation-sdk. `python -m monitoring DIR` writes
the JSON the chart ships (`make dashboards`); a test fails when the two drift.

The series' labels follow one convention: `namespace` and `rlhfjob` (the RLHFJob's
name) on every per-job series - on the trainer's series as Prometheus target labels
(the chart's PodMonitor), on the operator's as its own labels (its ServiceMonitor
honours them) - and `pool` where a series is per pool. `job` is left to Prometheus,
which uses it for the scrape job.
"""
