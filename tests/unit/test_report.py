"""The status reporter: what it sends, how often, and that failures never raise."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from rlhf_operator.api import crd
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.progress import PoolResize, TrainingProgress
from rlhf_trainer.cluster.hangs import RankOutOfMemory
from rlhf_trainer.loop.resize import ResizeWatch
from rlhf_trainer.telemetry import report
from rlhf_trainer.telemetry.report import (
    ApiServer,
    ConsoleReporter,
    RateLimit,
    StatusReporter,
    failure_line,
    reporter_from_env,
    status_url,
)
from tests.unit.conftest import EXAMPLES, load

TOKEN = "s3cret-token-value"
PROGRESS = TrainingProgress(
    step=3,
    total_steps=500,
    policy_version=3,
    reward_mean=0.25,
    kl=0.01,
    actor_grad_norm=1.5,
    critic_grad_norm=4.0,
    truncated_ratio=0.125,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_api_names_match_the_operators() -> None:
    assert (report.GROUP, report.VERSION, report.PLURAL) == (crd.GROUP, crd.VERSION, crd.PLURAL)
    assert (
        status_url("https://10.0.0.1:443/", "ns", "job")
        == "https://10.0.0.1:443/apis/rlhf.dev/v1alpha1/namespaces/ns/rlhfjobs/job/status"
    )


def test_rate_limit_lets_one_through_per_interval_and_forced_ones_always() -> None:
    clock = Clock()
    limit = RateLimit(5.0, clock)
    assert limit.allow()
    clock.now = 4.9
    assert not limit.allow()
    assert limit.allow(force=True)
    clock.now = 9.8
    assert not limit.allow()  # the forced one restarted the interval
    clock.now = 9.9
    assert limit.allow()


@pytest.fixture
def fake_api() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A plain-HTTP stand-in for the API server that records the requests it gets."""
    requests: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            requests.append(
                {"path": self.path, "headers": dict(self.headers), "body": json.loads(body)}
            )
            # Job "busy": unavailable twice, then taken; job "gone": not found.
            busy = "/busy/" in self.path and len(requests) <= 2
            self.send_response(503 if busy else 404 if "/gone/" in self.path else 200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", requests
    server.shutdown()
    server.server_close()


def test_reporter_sends_a_rate_limited_merge_patch_of_status_training(
    fake_api: tuple[str, list[dict[str, Any]]],
) -> None:
    url, requests = fake_api
    clock = Clock()
    reporter = StatusReporter("job", "ns", ApiServer(url, lambda: TOKEN), every=5, clock=clock)
    assert reporter.report(PROGRESS)
    assert not reporter.report(PROGRESS.model_copy(update={"step": 4}))  # too soon
    assert reporter.report(PROGRESS.model_copy(update={"step": 5}), final=True)
    assert [r["body"]["status"]["training"]["step"] for r in requests] == [3, 5]
    first = requests[0]
    assert first["path"] == "/apis/rlhf.dev/v1alpha1/namespaces/ns/rlhfjobs/job/status"
    assert first["headers"]["Content-Type"] == "application/merge-patch+json"
    assert first["headers"]["Authorization"] == f"Bearer {TOKEN}"
    # failure is always sent: its null removes an earlier attempt's
    assert first["body"] == {"status": {"training": PROGRESS.to_dict() | {"failure": None}}}
    training = first["body"]["status"]["training"]
    assert training["rewardMean"] == 0.25  # camelCase on the wire
    assert (training["actorGradNorm"], training["criticGradNorm"]) == (1.5, 4.0)
    assert training["truncatedRatio"] == 0.125


def test_a_failed_attempt_says_why_in_one_field_and_the_next_attempts_report_clears_it(
    fake_api: tuple[str, list[dict[str, Any]]],
) -> None:
    url, requests = fake_api
    reporter = StatusReporter("job", "ns", ApiServer(url, lambda: TOKEN))
    lost = RankOutOfMemory(
        "actor rank 3 on pool policy (update) ran out of memory: Tried to allocate 2.00 GiB."
        "\nmore lines of Ray's advice"
    )
    assert reporter.report_failure(failure_line(lost))
    assert requests[-1]["body"] == {"status": {"training": {"failure": (
        "RankOutOfMemory: actor rank 3 on pool policy (update) ran out of memory: "
        "Tried to allocate 2.00 GiB."
    )}}}  # fmt: skip
    assert requests[-1]["headers"]["Content-Type"] == "application/merge-patch+json"
    assert reporter.report(PROGRESS)  # the next attempt's first report
    assert requests[-1]["body"]["status"]["training"]["failure"] is None


def test_the_final_report_is_tried_again_while_it_may_pass_and_each_failure_is_logged(
    fake_api: tuple[str, list[dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    url, requests = fake_api
    slept: list[float] = []
    busy = StatusReporter("busy", "ns", ApiServer(url, lambda: TOKEN), sleep=slept.append)
    with caplog.at_level(logging.WARNING):
        assert busy.report(PROGRESS, final=True)
    assert len(requests) == 3 and slept == [1.0, 2.0]
    assert caplog.text.count("HTTP 503") == 2 and "try 2 of 3" in caplog.text
    # A refusal no retry changes is not tried again.
    gone = StatusReporter("gone", "ns", ApiServer(url, lambda: TOKEN), sleep=slept.append)
    assert not gone.report(PROGRESS, final=True)
    assert len(requests) == 4 and slept == [1.0, 2.0] and "HTTP 404" in caplog.text


def test_an_unreachable_api_server_logs_a_warning_without_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = ApiServer("https://127.0.0.1:1", lambda: TOKEN)  # nothing listens on port 1
    assert TOKEN not in repr(server)
    slept: list[float] = []
    with caplog.at_level(logging.WARNING):
        assert not StatusReporter("job", "ns", server, sleep=slept.append).report(
            PROGRESS, final=True
        )
    assert "could not report progress to rlhfjob ns/job (final, try 3 of 3)" in caplog.text
    assert "the final progress report (step 3 of 500) never reached rlhfjob ns/job" in caplog.text
    assert TOKEN not in caplog.text and slept == [1.0, 2.0]


def test_a_missing_token_file_is_a_warning_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = ApiServer("https://127.0.0.1:1", lambda: (tmp_path / "token").read_text())
    with caplog.at_level(logging.WARNING):
        assert not StatusReporter("job", "ns", server).report(PROGRESS)
    assert "FileNotFoundError" in caplog.text


def test_local_mode_prints_progress_lines() -> None:
    out = io.StringIO()
    clock = Clock()
    console = ConsoleReporter(out, every=1.0, clock=clock)
    assert console.report(PROGRESS)
    assert not console.report(PROGRESS)
    assert console.report(PROGRESS.model_copy(update={"samples_per_second": 12.5}), final=True)
    assert out.getvalue().splitlines() == [
        "step 3/500 (0%) · policy v3 · reward 0.250",
        "step 3/500 (0%) · policy v3 · reward 0.250 · 12.5 samples/s",
    ]


def test_from_env_reports_in_the_pod_and_prints_elsewhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    pod_env = {
        "RLHF_JOB_NAME": "job",
        "RLHF_JOB_NAMESPACE": "ns",
        "KUBERNETES_SERVICE_HOST": "fd00::1",
        "KUBERNETES_SERVICE_PORT": "443",
    }
    in_pod = reporter_from_env(pod_env, tmp_path)
    assert isinstance(in_pod, StatusReporter)
    assert (in_pod.name, in_pod.namespace) == ("job", "ns")
    server = ApiServer.in_cluster(pod_env, tmp_path)
    assert server is not None and server.url == "https://[fd00::1]:443"
    assert server.token() == TOKEN and server.ca_file == tmp_path / "ca.crt"

    assert isinstance(reporter_from_env({}, tmp_path), ConsoleReporter)
    with caplog.at_level(logging.WARNING):
        no_token = reporter_from_env(pod_env, tmp_path / "missing")
    assert isinstance(no_token, ConsoleReporter)
    assert "printing progress instead" in caplog.text


def test_a_run_stops_for_a_resize_of_its_own_pools_only_reading_the_job_now_and_then() -> None:
    """loop.resize.ResizeWatch, the run's `stop` on a cluster: it reads the operator's
    status.resizing at most every 5 s, and stops for pools whose new size this attempt
    has not got (a stale entry, once the next attempt runs on it, does not stop it)."""
    config = JobConfig.model_validate(load(EXAMPLES[0].parent / "local-cpu.yaml")["spec"])
    grown = [PoolResize(pool="policy", from_replicas=1, to_replicas=2)]
    stale = [PoolResize(pool="policy", from_replicas=2, to_replicas=1)]  # policy has 1
    reads: list[list[PoolResize] | None] = [None, stale, grown]
    clock = Clock()
    watch = ResizeWatch(config, lambda: reads.pop(0), every=5, clock=clock)
    assert not watch()  # unreadable: go on
    assert not watch() and len(reads) == 2  # too soon to read again
    clock.now = 5.0
    assert not watch()  # stale
    clock.now = 10.0
    assert watch() and watch.due == grown and not reads
    assert watch()  # stays stopped, without reading again
