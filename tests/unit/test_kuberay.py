"""The operator refuses, by condition and event, to start a job the installed KubeRay
would break: a CRD that drops the fields pinning pools to Ray nodes (KubeRay <= 1.4),
or a KubeRay whose probes need wget (1.5).

The older CRDs are KubeRay 1.7.0's with what 1.4.2 and 1.5.1 lack taken out (compared
field by field with those releases' config/crd/bases/ray.io_rayjobs.yaml)."""

from __future__ import annotations

import contextlib
import copy
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.kuberay import KubeRayCheck, ask_head, incompatibility
from rlhf_operator.render.children import JobRef, render_children
from tests.unit.conftest import EXAMPLES, load

SCHEMA = json.loads(
    (Path(__file__).parent / "data" / "kuberay-v1.7.0-rayjob-schema.json").read_text()
)["schema"]


def crd(schema: dict[str, Any]) -> dict[str, Any]:
    version = {"name": "v1", "served": True, "schema": {"openAPIV3Schema": schema}}
    return {"spec": {"versions": [version]}}


def kuberay_1_5() -> dict[str, Any]:
    schema = copy.deepcopy(SCHEMA)
    del schema["properties"]["spec"]["properties"]["preRunningDeadlineSeconds"]
    return schema


def kuberay_1_4() -> dict[str, Any]:
    schema = kuberay_1_5()
    cluster = schema["properties"]["spec"]["properties"]["rayClusterSpec"]["properties"]
    for group in (cluster["headGroupSpec"], cluster["workerGroupSpecs"]["items"]):
        del group["properties"]["resources"], group["properties"]["labels"]
    return schema


def rayjob(example: str = "split-8gpu-4-4.yaml") -> dict[str, Any]:
    job = parse_job(load(EXAMPLES[0].parent / example))
    return render_children(JobRef(job.metadata.name, "ns", "uid"), job.spec)[-1]


def test_kuberay_1_7_runs_every_example() -> None:
    for path in EXAMPLES:
        assert incompatibility(crd(SCHEMA), rayjob(path.name)) is None, path.name


@pytest.mark.parametrize(
    ("installed", "words"),
    [
        (None, "KubeRay is not installed (no CustomResourceDefinition rayjobs.ray.io)"),
        (crd(kuberay_1_4()), "workerGroupSpecs[0].resources"),
        (
            crd(kuberay_1_5()),
            "older than 1.6 (its RayJob CRD has no spec.preRunningDeadlineSeconds)",
        ),
        (
            {"spec": {"versions": [{"name": "v1alpha1", "served": True}]}},
            "does not serve RayJob v1",
        ),
    ],
    ids=["missing", "1.4-drops-fields", "1.5-probes-with-wget", "no-v1"],
)
def test_an_older_kuberay_is_named_with_what_it_lacks(installed: Any, words: str) -> None:
    problem = incompatibility(installed, rayjob())
    assert problem is not None and words in problem and "KubeRay >= 1.6 is needed" in problem


class FakeCrdReader:
    """Kube.get for the CRD alone, counting reads (the reconcile tests use a real API
    server; this is the re-read schedule)."""

    def __init__(self, crd: dict[str, Any] | None) -> None:
        self.crd, self.reads = crd, 0

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (kind, namespace, name) == ("CustomResourceDefinition", "", "rayjobs.ray.io")
        self.reads += 1
        return self.crd


def test_the_crd_is_read_again_once_a_minute_old_both_ways() -> None:
    """Upgraded, or replaced by an older CRD while the operator runs: a new attempt a
    minute later is checked against what is installed then (seen on `make cluster`: a
    kept check let a job start on a CRD that would drop its fields)."""
    now = [0.0]
    reader = FakeCrdReader(crd(kuberay_1_4()))
    check = KubeRayCheck(reader, clock=lambda: now[0])  # type: ignore[arg-type]
    assert check.problem(rayjob()) is not None
    assert check.problem(rayjob()) is not None and reader.reads == 1  # not yet re-read
    reader.crd = crd(SCHEMA)  # KubeRay upgraded
    now[0] = 61.0
    assert check.problem(rayjob()) is None and reader.reads == 2
    now[0] = 100.0
    assert check.problem(rayjob()) is None and reader.reads == 2  # a burst: one read
    reader.crd = crd(kuberay_1_4())  # the CRD replaced by an older one
    now[0] = 122.0
    assert check.problem(rayjob()) is not None and reader.reads == 3


def test_a_head_that_cannot_say_is_an_error_the_reconcile_catches() -> None:
    """ask_head raises OSError (nothing listens) or ValueError (no JSON object): the
    reconcile takes either as no answer, and KubeRay's late Failed stands."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed on leaving: nothing listens there
    with pytest.raises(OSError):
        ask_head(f"http://127.0.0.1:{port}/api/jobs/x")
    with _serving(b"[1, 2]") as url, pytest.raises(ValueError, match="answered"):
        ask_head(url)
    with _serving(b'{"status": "FAILED"}') as url:
        assert ask_head(url) == {"status": "FAILED"}


@contextlib.contextmanager
def _serving(body: bytes) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api/jobs/x"
    finally:
        server.shutdown()
        server.server_close()
