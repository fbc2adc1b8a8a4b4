"""Test tiers as markers, from the directory a test lives in: `pytest -m unit` (no
cluster), `-m trainer` (Ray and vLLM on this machine), `-m controlplane` (a real
Kubernetes control plane). `slow` marks tests over about 20 s (by hand, where they are)."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
TIERS = ("unit", "trainer", "controlplane")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)
