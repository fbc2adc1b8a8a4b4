"""Test tiers as markers, from the directory a test lives in: `pytest -m unit` (no
cluster), `-m trainer` (Ray and vLLM on this machine), `-m controlplane` (a real
Kubernetes control plane). `slow` marks tests over about 20 s (by hand, where they are).

`make test` runs two pytest-xdist workers, one group of tests at a time each: a module,
or the whole control-plane tier (which shares one control plane). A trainer run spends
about 40% of its start-up waiting (Ray's nodes, vLLM's engine process), so two groups
side by side use the two cores that one leaves half idle."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
TIERS = ("unit", "trainer", "controlplane")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups from the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)
        # Module- and session-scoped set-up (a trained run, a control plane) is built
        # once per xdist worker: a group keeps the tests that share it on one worker.
        group = tier if tier == "controlplane" else item.path.relative_to(TESTS).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
