"""Benchmark: create -> child latency of our operator against KubeRay's own, in one run.

On one real control plane (tests/controlplane), for N = 1, 100, 500:
  ours:    create N RLHFJobs, time until each one's RayJob appears (watch ADDED);
  kuberay: create N RayJobs, time until each one's RayCluster appears.
Jobs are created with suspend: true so KubeRay does not start pods for them; the
KubeRay side uses our rendered RayJob unsuspended, so KubeRay does its usual work.
Prints one JSON line per N. Run: make bench-operator (takes a few minutes).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from kubernetes import watch

from rlhf_operator.kube import Kube
from rlhf_operator.render import JobRef, render_rayjob
from rlhf_operator.validation import parse_job
from tests.controlplane.harness import ControlPlane
from tests.controlplane.operator_process import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
SIZES = [int(n) for n in sys.argv[1:]] or [1, 100, 500]
CLIENT_THREADS = 8


def tiny_job(name: str, namespace: str) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((REPO / "examples" / "colocated.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": namespace}
    job["spec"]["pools"][0]["gpusPerNode"] = 1
    job["spec"]["trainer"] = {"batchSize": 8, "miniBatchSize": 8}
    job["spec"]["suspend"] = True
    return job


def owner_name(obj: dict[str, Any]) -> str:
    name: str = obj["metadata"]["ownerReferences"][0]["name"]
    return name


class Appearances:
    """Watches a kind in a namespace and records when each owner's child first appears."""

    def __init__(self, kube: Kube, plural: str, namespace: str, owner_of: Any) -> None:
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(kube, plural, namespace, owner_of), daemon=True
        )
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(10)

    def _run(self, kube: Kube, plural: str, namespace: str, owner_of: Any) -> None:
        from kubernetes import client

        api = client.CustomObjectsApi(kube.api)
        stream = watch.Watch()
        self._ready.set()
        events = stream.stream(
            api.list_namespaced_custom_object,
            "ray.io",
            "v1",
            namespace,
            plural,
            timeout_seconds=900,
        )
        for event in events:
            if event["type"] == "ADDED":
                self.seen.setdefault(owner_of(event["object"]), time.monotonic())
            if self._stop.is_set():
                stream.stop()

    def wait_for(self, names: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not all(n in self.seen for n in names):
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in self.seen]
                raise TimeoutError(f"{len(missing)} children never appeared, e.g. {missing[:3]}")
            time.sleep(0.05)
        self._stop.set()


def create_all(kube: Kube, objects: list[dict[str, Any]]) -> dict[str, float]:
    started: dict[str, float] = {}

    def create(obj: dict[str, Any]) -> None:
        started[obj["metadata"]["name"]] = time.monotonic()
        kube.create(obj)

    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(create, objects))
    return started


def latencies(started: dict[str, float], seen: dict[str, float]) -> list[float]:
    return sorted(seen[name] - t0 for name, t0 in started.items())


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(cp: ControlPlane, op: OperatorProcess, kube: Kube, n: int) -> dict[str, Any]:
    ours_ns, theirs_ns = f"bench-ours-{n}", f"bench-kuberay-{n}"
    cp.create_namespace(ours_ns)
    cp.create_namespace(theirs_ns)

    watcher = Appearances(kube, "rayjobs", ours_ns, owner_name)
    started = create_all(kube, [tiny_job(f"job-{i}", ours_ns) for i in range(n)])
    watcher.wait_for(list(started))
    ours = latencies(started, watcher.seen)

    spec = parse_job(tiny_job("x", theirs_ns)).spec.model_copy(update={"suspend": False})
    rayjobs = []
    for i in range(n):
        rayjob = render_rayjob(JobRef(f"rayjob-{i}", theirs_ns, "0"), spec)
        del rayjob["metadata"]["ownerReferences"]  # a plain RayJob, as a KubeRay user makes it
        rayjobs.append(rayjob)
    watcher = Appearances(
        kube, "rayclusters", theirs_ns, lambda o: o["metadata"]["ownerReferences"][0]["name"]
    )
    started = create_all(kube, rayjobs)
    watcher.wait_for(list(started))
    theirs = latencies(started, watcher.seen)

    for ns in (ours_ns, theirs_ns):
        cp.kubectl("delete", "namespace", ns, "--wait=false")
    return {
        "n": n,
        "ours_p50_s": round(statistics.median(ours), 3),
        "ours_p99_s": round(percentile(ours, 0.99), 3),
        "kuberay_p50_s": round(statistics.median(theirs), 3),
        "kuberay_p99_s": round(percentile(theirs, 0.99), 3),
        "ratio_p99": round(percentile(ours, 0.99) / percentile(theirs, 0.99), 3),
        "operator_rss_mb": round(peak_rss_mb(op.proc.pid), 1) if op.proc else None,
    }


def main() -> None:
    with ControlPlane() as cp:
        op = OperatorProcess(cp, "bench-operator").start()
        try:
            kube = Kube(cp.api_client())
            results = []
            for n in SIZES:
                results.append(measure(cp, op, kube, n))
                print(json.dumps(results[-1]), flush=True)
            print(json.dumps({"bench": "operator", "sizes": results}), flush=True)
        finally:
            op.stop()


if __name__ == "__main__":
    main()
