"""The operator as users run it (`python -m rlhf_operator`), pointed at the test cluster.

Its log goes to the control plane's logs folder, so a failing test shows it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .harness import ControlPlane
from .processes import free_ports


class OperatorProcess:
    def __init__(
        self,
        cp: ControlPlane,
        name: str = "rlhf-operator",
        *args: str,
        kubeconfig: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`kubeconfig`: who the operator is (the control plane's admin by default);
        `env`: more environment (the settings the chart passes)."""
        self.cp = cp
        self.kubeconfig = kubeconfig or cp.kubeconfig
        self.extra_env = env or {}
        self.name = name
        self.args = args or ("--standalone", "--all-namespaces")
        self.port = free_ports(1)[0]
        self.log_path = cp.logs_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    def start(self, wait_ready: bool = True) -> OperatorProcess:
        env = {
            **self.cp.env(),
            "KUBECONFIG": str(self.kubeconfig),
            **self.extra_env,
            "RLHF_OPERATOR_HEALTH_PORT": str(self.port),
        }
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()  # the log file is shared by this name's runs
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlhf_operator", *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        if wait_ready:
            self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, f"{self.name} exited"
            try:
                if self._get("/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def _get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
            return response.status, response.read().decode()

    def log(self) -> str:
        """What it has logged since it last started."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """The value of the sample `name` with exactly these labels, e.g. a histogram's
        _count (0 if it has none yet)."""
        return next((value for found, value in self.metrics(name) if found == labels), 0.0)

    def metrics(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every sample `name`, with its labels."""
        return [
            (sample.labels, float(sample.value))
            for family in text_string_to_metric_families(self._get("/metrics")[1])
            for sample in family.samples
            if sample.name == name
        ]

    def kill(self) -> None:
        """SIGKILL: no chance to finish what it was doing."""
        self._signal(signal.SIGKILL, grace=10)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, grace=20)
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def _signal(self, sig: int, grace: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
