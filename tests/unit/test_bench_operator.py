"""The operator bench's pure parts: its percentiles, its ratios and its unrelated objects."""

from __future__ import annotations

import pytest

from bench.operator.clutter import app_configmap, app_pod
from bench.operator.run import compare, latency_figures, percentile
from rlhf_operator.render.children import JOB_LABEL


def test_percentile_is_an_observed_value_of_the_sorted_samples() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.5) == 51.0  # round(49.5) = 50 -> the 51st smallest
    assert percentile([3.0], 0.99) == 3.0


def test_ratios_are_ours_over_kuberays_within_one_repeat() -> None:
    ours = latency_figures(child=[1.0, 2.0, 3.0], status=[2.0, 4.0, 6.0])
    theirs = latency_figures(child=[2.0, 4.0, 6.0], status=[1.0, 2.0, 3.0])
    ratios = compare({"ours": ours, "kuberay": theirs})
    assert ratios["ratio_p50"] == pytest.approx(0.5)
    assert ratios["ratio_p99"] == pytest.approx(0.5)
    assert ratios["ratio_status_p50"] == pytest.approx(2.0)
    assert ratios["ratio_status_p99"] == pytest.approx(2.0)


def test_clutter_is_none_of_the_operators_business_and_never_scheduled() -> None:
    pod, configmap = app_pod("web-0", "clutter-0"), app_configmap("settings-0", "clutter-0")
    for obj in (pod, configmap):
        assert JOB_LABEL not in obj["metadata"]["labels"]
    assert pod["spec"]["schedulingGates"]  # kube-scheduler and kwok leave it alone
