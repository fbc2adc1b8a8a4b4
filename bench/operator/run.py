"""Benchmark: create -> child latency of our operator against KubeRay's own, in one run.

On one real control plane (tests/controlplane), for N = 1, 100, 500, 1000:
  ours:    create N RLHFJobs, time until each one's RayJob appears (watch ADDED);
  kuberay: create N RayJobs, time until each one's RayCluster appears.
Also each RLHFJob's time until its status is first written: in a burst, a new job's
report waits for the other new jobs' RayJobs (controller/workqueue.py), and this says
what that costs.
N = 1 is one job at a time, ROUNDS_OF_ONE times, ours and KubeRay's alternating (one
sample of a single job is noise). Jobs are created with suspend: true so KubeRay does
not start pods for them; the KubeRay side uses our rendered RayJob unsuspended, so
KubeRay does its usual work. Prints one JSON line per N, with the operator's peak RSS so
far. Run: make bench-operator (about 25 minutes); sizes can be given: `... run 1 100`.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from kubernetes import watch
from urllib3.exceptions import ProtocolError

from rlhf_operator.api.job import GROUP, PLURAL, VERSION
from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.kube import Kube
from rlhf_operator.render.children import JobRef, render_rayjob
from tests.controlplane.harness import ControlPlane
from tests.controlplane.operator_process import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
SIZES = [int(n) for n in sys.argv[1:]] or [1, 100, 500, 1000]
CLIENT_THREADS = 8
ROUNDS_OF_ONE = 20


def tiny_job(name: str, namespace: str) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((REPO / "examples" / "colocated.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": namespace}
    job["spec"]["pools"][0]["gpusPerNode"] = 1
    job["spec"]["trainer"] = {"batchSize": 8, "miniBatchSize": 8}
    job["spec"]["suspend"] = True
    return job


Event = dict[str, Any]  # a watch event: {"type": ..., "object": ...}


def child_added(event: Event) -> str | None:
    """The owner's name of a child that appeared."""
    if event["type"] != "ADDED":
        return None
    name: str = event["object"]["metadata"]["ownerReferences"][0]["name"]
    return name


def status_written(event: Event) -> str | None:
    """The name of a job whose status is there."""
    name: str = event["object"]["metadata"]["name"]
    return name if event["object"].get("status") else None


class Appearances:
    """Watches a kind in a namespace and records when each name that `seen_in` finds in
    an event was first found."""

    def __init__(self, kube: Kube, kind: tuple[str, str, str], namespace: str,
                 seen_in: Callable[[Event], str | None]) -> None:  # fmt: skip
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(kube, kind, namespace, seen_in), daemon=True
        )
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(10)

    def _run(self, kube: Kube, kind: tuple[str, str, str], namespace: str,
             seen_in: Callable[[Event], str | None]) -> None:  # fmt: skip
        from kubernetes import client

        api = client.CustomObjectsApi(kube.api)
        stream = watch.Watch()  # type: ignore[no-untyped-call]
        self._ready.set()
        group, version, plural = kind
        events = stream.stream(  # type: ignore[no-untyped-call]
            api.list_namespaced_custom_object, group, version, namespace, plural,
            timeout_seconds=900,
        )  # fmt: skip
        try:
            for event in events:
                name = seen_in(event)
                if name is not None:
                    self.seen.setdefault(name, time.monotonic())
                if self._stop.is_set():
                    stream.stop()  # type: ignore[no-untyped-call]
        except ProtocolError:
            if not self._stop.is_set():
                raise  # else the control plane stopped under a watch no longer needed

    def wait_for(self, names: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not all(n in self.seen for n in names):
            if not self._thread.is_alive():
                raise RuntimeError("the watch ended early (its error is printed above)")
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in self.seen]
                raise TimeoutError(f"{len(missing)} children never appeared, e.g. {missing[:3]}")
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()  # the stream ends at its next event


def create_all(kube: Kube, objects: list[dict[str, Any]]) -> dict[str, float]:
    started: dict[str, float] = {}

    def create(obj: dict[str, Any]) -> None:
        started[obj["metadata"]["name"]] = time.monotonic()
        kube.create(obj)

    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(create, objects))
    return started


def latencies(
    kube: Kube, objects: list[dict[str, Any]], *watchers: Appearances
) -> list[list[float]]:
    """Create the objects at once; by watcher, each one's time until it was seen."""
    started = create_all(kube, objects)
    for watcher in watchers:
        watcher.wait_for(list(started))
    return [[w.seen[name] - t0 for name, t0 in started.items()] for w in watchers]


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(cp: ControlPlane, op: OperatorProcess, kube: Kube, n: int, run: int) -> dict[str, Any]:
    """N jobs at once (N = 1: ROUNDS_OF_ONE times); `run` numbers the namespaces."""
    ours_ns, theirs_ns = f"bench-ours-{run}-n{n}", f"bench-kuberay-{run}-n{n}"
    cp.create_namespace(ours_ns)
    cp.create_namespace(theirs_ns)
    spec = parse_job(tiny_job("x", theirs_ns)).spec.model_copy(update={"suspend": False})

    def plain_rayjob(name: str) -> dict[str, Any]:
        rayjob = render_rayjob(JobRef(name, theirs_ns, "0"), spec)
        del rayjob["metadata"]["ownerReferences"]  # a plain RayJob, as a KubeRay user makes it
        return rayjob

    ours_watch = Appearances(kube, ("ray.io", "v1", "rayjobs"), ours_ns, child_added)
    status_watch = Appearances(kube, (GROUP, VERSION, PLURAL), ours_ns, status_written)
    theirs_watch = Appearances(kube, ("ray.io", "v1", "rayclusters"), theirs_ns, child_added)
    ours: list[float] = []
    ours_status: list[float] = []
    theirs: list[float] = []
    for round_ in range(ROUNDS_OF_ONE if n == 1 else 1):
        names = [f"job-{round_}-{i}" for i in range(n)]
        jobs = [tiny_job(name, ours_ns) for name in names]
        rayjobs, statuses = latencies(kube, jobs, ours_watch, status_watch)
        ours += rayjobs
        ours_status += statuses
        theirs += latencies(kube, [plain_rayjob(name) for name in names], theirs_watch)[0]
    for watcher in (ours_watch, status_watch, theirs_watch):
        watcher.close()
    for ns in (ours_ns, theirs_ns):
        cp.kubectl("delete", "namespace", ns, "--wait=false")
    ours.sort()
    ours_status.sort()
    theirs.sort()
    return {
        "n": n,
        "samples": len(ours),
        "ours_p50_s": round(statistics.median(ours), 3),
        "ours_p99_s": round(percentile(ours, 0.99), 3),
        "ours_status_p99_s": round(percentile(ours_status, 0.99), 3),
        "kuberay_p50_s": round(statistics.median(theirs), 3),
        "kuberay_p99_s": round(percentile(theirs, 0.99), 3),
        "ratio_p50": round(statistics.median(ours) / statistics.median(theirs), 3),
        "ratio_p99": round(percentile(ours, 0.99) / percentile(theirs, 0.99), 3),
        "operator_rss_mb": round(peak_rss_mb(op.proc.pid), 1) if op.proc else None,
    }


def main() -> None:
    with ControlPlane() as cp:
        op = OperatorProcess(cp, "bench-operator").start()
        try:
            kube = Kube(cp.api_client())  # type: ignore[no-untyped-call]
            results = []
            for run, n in enumerate(SIZES):
                results.append(measure(cp, op, kube, n, run))
                print(json.dumps(results[-1]), flush=True)
            print(json.dumps({"bench": "operator", "sizes": results}), flush=True)
        finally:
            op.stop()


if __name__ == "__main__":
    main()
