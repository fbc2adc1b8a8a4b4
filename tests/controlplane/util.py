"""Small helpers shared by the control-plane tests."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from .harness import BIN_DIR, ControlPlane

WAIT = 90  # seconds; generous because a 2-core machine may be busy
T = TypeVar("T")


def eventually(fn: Callable[[], T], what: str, timeout: float = WAIT) -> T:
    """Poll fn until it returns something truthy; fail with `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; last value: {last!r}")


def get_json(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl("get", *args, "-o", "json").stdout)


def kubectl_as(cp: ControlPlane, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    """kubectl authenticated only by a bearer token (no admin certificate)."""
    argv = [str(BIN_DIR / "kubectl"), "--kubeconfig=/dev/null", f"--server={cp.server}",
            f"--certificate-authority={cp.ca_file}", f"--token={token}", *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)
