from __future__ import annotations

import copy
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


@pytest.fixture
def local_job() -> dict[str, Any]:
    """A fresh copy of the small local example, for tests to break in one place."""
    return copy.deepcopy(load(EXAMPLES[0].parent / "local-cpu.yaml"))


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """SIGINT handled as Python sets it up in a terminal: a test run started in the
    background inherits it ignored, and Python then leaves it ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
