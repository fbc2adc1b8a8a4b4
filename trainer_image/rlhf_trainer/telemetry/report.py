"""Training progress into the RLHFJob's `status.training`, or onto the console locally.

On the cluster the driver runs as `<job>-reporter`, a service account that may only
get and patch `rlhfjobs/status` of its own job. It reads the operator's
`status.resizing` there too (loop.resize). Progress goes there as a JSON merge
patch of `{"status": {"training": …}}` on the status subresource, over plain
urllib + ssl with the pod's mounted token and CA: the trainer needs no Kubernetes
client. Without RLHF_JOB_NAME (local mode) progress is printed instead.

Reporting is best effort: a failed patch logs a warning (never the token) and
training carries on. Patches are rate-limited; the final one always goes out.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from rlhf_trainer.api.names import GROUP, PLURAL, VERSION
from rlhf_trainer.api.progress import PoolResize, TrainingProgress

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REPORT_EVERY = 5.0  # seconds between status patches: the API server is shared
# The final report is tried this often, a second more between tries: without it the
# operator sees a job end short of its last step (it warns that progress never came).
FINAL_ATTEMPTS = 3
PRINT_EVERY = 1.0  # seconds between progress lines in local mode


class Reporter(Protocol):
    def report(self, progress: TrainingProgress, final: bool = False) -> bool:
        """Pass progress on unless rate-limited; True if it went out."""
        ...


@dataclass(frozen=True)
class ApiServer:
    """Where the API server is and how to authenticate to it."""

    url: str  # https://host:port
    # Read at every request: projected service-account tokens are rotated in place.
    token: Callable[[], str] = field(repr=False)
    ca_file: Path | None = None  # None: the system's trust store

    @classmethod
    def in_cluster(
        cls, env: Mapping[str, str], account_dir: Path = SERVICE_ACCOUNT_DIR
    ) -> ApiServer | None:
        """The pod's own API server, or None outside a pod or without a mounted token."""
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        token_file = account_dir / "token"
        if not host or not port or not token_file.is_file():
            return None
        host = f"[{host}]" if ":" in host else host  # an IPv6 service address
        return cls(
            url=f"https://{host}:{port}",
            token=lambda: token_file.read_text().strip(),
            ca_file=account_dir / "ca.crt",
        )


def status_url(server: str, namespace: str, name: str) -> str:
    return (
        f"{server.rstrip('/')}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
    )


def status_patch(progress: TrainingProgress) -> bytes:
    """A merge patch that sets `status.training` and leaves the operator's fields alone.
    `failure` is always sent: its null removes an earlier attempt's."""
    training = progress.to_dict() | {"failure": progress.failure}
    return json.dumps({"status": {"training": training}}).encode()


def failure_patch(failure: str) -> bytes:
    """A merge patch that sets only `status.training.failure`."""
    return json.dumps({"status": {"training": {"failure": failure}}}).encode()


def failure_line(error: BaseException, limit: int = 500) -> str:
    """An error as the job's status says why its attempt failed: its type and first line."""
    first = str(error).strip().split("\n", 1)[0]
    return f"{type(error).__name__}: {first}"[:limit] if first else type(error).__name__


class RateLimit:
    """Lets one event through every `every` seconds; forced ones always pass."""

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._every = every
        self._clock = clock
        self._last: float | None = None

    def allow(self, force: bool = False) -> bool:
        now = self._clock()
        if not force and self._last is not None and now - self._last < self._every:
            return False
        self._last = now
        return True


class StatusReporter:
    """Patches `status.training` of one RLHFJob."""

    def __init__(
        self,
        name: str,
        namespace: str,
        server: ApiServer,
        every: float = REPORT_EVERY,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self._server = server
        self._url = status_url(server.url, namespace, name)
        self._timeout = timeout
        # Failed attempts count too, so an unreachable API server is not hammered.
        self._limit = RateLimit(every, clock)
        self._sleep = sleep

    def report(self, progress: TrainingProgress, final: bool = False) -> bool:
        if not self._limit.allow(force=final):
            return False
        attempts = FINAL_ATTEMPTS if final else 1
        for attempt in range(1, attempts + 1):
            try:
                self._patch(progress)
                return True
            except Exception as error:  # reporting must never stop training
                log.warning("could not report progress to rlhfjob %s/%s (%s, try %d of %d): %s",
                            self.namespace, self.name, "final" if final else "periodic",
                            attempt, attempts, _describe(error))  # fmt: skip
                if _refused_for_good(error):
                    break
            if attempt < attempts:
                self._sleep(float(attempt))
        if final:
            log.error("the final progress report (step %d of %d) never reached rlhfjob %s/%s: "
                      "its status keeps an earlier step", progress.step, progress.total_steps,
                      self.namespace, self.name)  # fmt: skip
        return False

    def report_failure(self, failure: str) -> bool:
        """Say in the job's status why this attempt failed (`failure_line`), before the
        driver exits: the operator's Ready condition and events then give it."""
        try:
            self._request("PATCH", failure_patch(failure), "application/merge-patch+json")
            return True
        except Exception as error:  # the driver's own error is what matters
            log.warning("could not report the failure to rlhfjob %s/%s: %s", self.namespace,
                        self.name, _describe(error))  # fmt: skip
            return False

    def resizing(self) -> list[PoolResize] | None:
        """The pools the operator is resizing (its status.resizing); None when it could
        not be read (logged: the run goes on)."""
        try:
            status = json.loads(self._request("GET")).get("status") or {}
        except Exception as error:
            log.warning("could not read rlhfjob %s/%s: %s", self.namespace, self.name,
                        _describe(error))  # fmt: skip
            return None
        return [PoolResize.model_validate(r) for r in status.get("resizing") or []]

    def _patch(self, progress: TrainingProgress) -> None:
        self._request("PATCH", status_patch(progress), "application/merge-patch+json")

    def _request(self, method: str, body: bytes | None = None, content_type: str = "") -> bytes:
        ca = self._server.ca_file
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
        headers = {"Authorization": f"Bearer {self._server.token()}", "Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self._url, data=body, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=self._timeout, context=context) as response:
            return bytes(response.read())


def _refused_for_good(error: Exception) -> bool:
    """A client error (403 forbidden, 404 no such job) that no retry changes; 429 (too
    many requests) and every server or network error may pass later."""
    return (
        isinstance(error, urllib.error.HTTPError) and 400 <= error.code < 500 and error.code != 429
    )


def _describe(error: Exception) -> str:
    """What went wrong, for the log: the API server's own message where it sent one."""
    if isinstance(error, urllib.error.HTTPError):
        try:
            message = json.loads(error.read()).get("message", "")
        except (ValueError, OSError, AttributeError):
            message = ""
        return f"HTTP {error.code} {error.reason}" + (f": {message}" if message else "")
    if isinstance(error, urllib.error.URLError):
        return f"cannot reach the API server: {error.reason}"
    return f"{type(error).__name__}: {error}"


class ConsoleReporter:
    """Local mode: one progress line at a time on a terminal stream."""

    def __init__(
        self,
        stream: TextIO | None = None,
        every: float = PRINT_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._limit = RateLimit(every, clock)

    def report(self, progress: TrainingProgress, final: bool = False) -> bool:
        if not self._limit.allow(force=final):
            return False
        print(progress_line(progress), file=self._stream or sys.stderr, flush=True)
        return True


def progress_line(progress: TrainingProgress) -> str:
    """e.g. "step 30/500 (6%) · policy v30 · reward 0.412 · 12.5 samples/s"."""
    parts = [f"step {progress.step}/{progress.total_steps}"]
    if progress.total_steps:
        parts[0] += f" ({100 * progress.step // progress.total_steps}%)"
    parts.append(f"policy v{progress.policy_version}")
    if progress.reward_mean is not None:
        parts.append(f"reward {progress.reward_mean:.3f}")
    if progress.samples_per_second is not None:
        parts.append(f"{progress.samples_per_second:.1f} samples/s")
    if progress.last_checkpoint:
        parts.append(f"checkpoint {progress.last_checkpoint}")
    return " · ".join(parts)


def reporter_from_env(
    env: Mapping[str, str] = os.environ, account_dir: Path = SERVICE_ACCOUNT_DIR
) -> Reporter:
    """A StatusReporter inside the job's head pod; a ConsoleReporter anywhere else."""
    name = env.get("RLHF_JOB_NAME")
    if not name:
        return ConsoleReporter()
    namespace = env.get("RLHF_JOB_NAMESPACE")
    server = ApiServer.in_cluster(env, account_dir)
    if not namespace or server is None:
        log.warning(
            "RLHF_JOB_NAME is set but RLHF_JOB_NAMESPACE, the API server address or the "
            "service-account token is missing; printing progress instead of reporting it"
        )
        return ConsoleReporter()
    return StatusReporter(name, namespace, server)
