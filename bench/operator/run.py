"""Benchmark: our operator's create -> child latency against KubeRay's own, on equal terms.

On one real control plane (tests/controlplane) holding CLUTTER unrelated pods and as many
ConfigMaps (bench/operator/clutter.py), each repeat runs two phases:
  ours:    create N RLHFJobs at once; per job, the time until its RayJob appears and
           until its own status is first written;
  kuberay: create N RayJobs at once (our rendered RayJob, unsuspended, as a KubeRay user
           writes it); per job, the time until its RayCluster appears and until KubeRay
           first writes the RayJob's status.
Equal terms: each phase in a fresh namespace, deleted after it, and the next phase starts
only once both operators have nothing queued (KubeRay's work queues, ours); KubeRay runs
with as many reconcile workers as ours (--reconcile-concurrency, RLHF_OPERATOR_WORKERS)
and, like ours, no client-side rate limit. Our jobs are created with suspend: true, so
KubeRay starts no pods for our RayJobs.
Ratios (ours / KubeRay, p50 and p99, to the child and to the first status) are taken
within each repeat and reported as median (min-max). The operator's RSS is read after it
listed the clutter at start-up and after each of its phases, and the requests it made to
the API server per job, by verb and kind (its rlhf_operator_api_requests_total), from the
burst until it and KubeRay went quiet (reads answered by its cache are not requests).

Run: make bench-operator, or `.venv/bin/python -m bench.operator.run --n 100 --repeats 3`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.harness import Measurement, Spread, figures, interleave
from bench.operator import clutter
from bench.operator.kuberay import KubeRay, matched_kuberay, operator_activity, wait_quiet
from bench.operator.watches import Appearances, child_added, status_written
from rlhf_operator.api.job import GROUP, PLURAL, VERSION
from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.kube import Kube
from rlhf_operator.render.children import JobRef, render_rayjob
from tests.controlplane.harness import ControlPlane
from tests.controlplane.operator_process import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
CLIENT_THREADS = 8  # the "users" creating the burst
RAYJOBS = ("ray.io", "v1", "rayjobs")
RAYCLUSTERS = ("ray.io", "v1", "rayclusters")
RLHFJOBS = (GROUP, VERSION, PLURAL)


def tiny_job(name: str, namespace: str) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((REPO / "examples" / "colocated.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": namespace}
    job["spec"]["pools"][0]["gpusPerNode"] = 1
    job["spec"]["trainer"] = {"batchSize": 8, "miniBatchSize": 8}
    job["spec"]["suspend"] = True
    return job


def plain_rayjob(name: str, namespace: str) -> dict[str, Any]:
    """Our rendered RayJob, unsuspended and owned by no one, as a KubeRay user makes it."""
    spec = parse_job(tiny_job(name, namespace)).spec.model_copy(update={"suspend": False})
    rayjob = render_rayjob(JobRef(name, namespace, "0"), spec)
    del rayjob["metadata"]["ownerReferences"]
    return rayjob


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency_figures(child: list[float], status: list[float]) -> Measurement:
    return {
        "p50_s": statistics.median(child),
        "p99_s": percentile(child, 0.99),
        "status_p50_s": statistics.median(status),
        "status_p99_s": percentile(status, 0.99),
    }


def compare(run: dict[str, Measurement]) -> Measurement:
    """Ours over KubeRay's, within one repeat."""
    ours, theirs = run["ours"], run["kuberay"]
    keys = ("p50_s", "p99_s", "status_p50_s", "status_p99_s")
    return {f"ratio_{key.removesuffix('_s')}": ours[key] / theirs[key] for key in keys}


def api_requests(op: OperatorProcess) -> dict[str, float]:
    """The operator's requests to the API server so far, by "verb kind"."""
    return {
        f"{labels['verb']} {labels['kind']}": value
        for labels, value in op.metrics("rlhf_operator_api_requests_total")
    }


def per_job(before: dict[str, float], after: dict[str, float], n: int) -> Measurement:
    """Requests made between two counts, per job: {"requests.create_RayJob": 1.0, ...}."""
    moved = {key: after[key] - before.get(key, 0.0) for key in sorted(after)}
    counts = {f"requests.{key.replace(' ', '_')}": v / n for key, v in moved.items() if v}
    return {**counts, "requests.all": sum(moved.values()) / n}


def operator_memory(op: OperatorProcess) -> dict[str, float]:
    """The operator's resident memory now and at its peak (VmRSS, VmHWM)."""
    assert op.proc is not None
    status = Path(f"/proc/{op.proc.pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    return {
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024,
    }


@dataclass
class Bench:
    cp: ControlPlane
    op: OperatorProcess
    kuberay: KubeRay
    kube: Kube
    n: int
    phases: int = 0

    def fresh_namespace(self, side: str) -> str:
        self.phases += 1
        namespace = f"bench-{side}-{self.phases}"
        self.cp.create_namespace(namespace)
        return namespace

    def burst(self, objects: list[dict[str, Any]], *watches: Appearances) -> list[list[float]]:
        """Create the objects at once; by watch, each one's seconds until it was seen."""
        started: dict[str, float] = {}

        def create(obj: dict[str, Any]) -> None:
            started[obj["metadata"]["name"]] = time.monotonic()
            self.kube.create(obj)

        with ThreadPoolExecutor(CLIENT_THREADS) as pool:
            list(pool.map(create, objects))
        for watch in watches:
            watch.wait_for(list(started))
            watch.close()
        return [watch.after(started) for watch in watches]

    def clear(self, namespace: str, measured: Measurement) -> None:
        """Delete the phase's namespace, then wait until both operators are idle."""
        began = time.monotonic()
        self.cp.kubectl("delete", "namespace", namespace, "--timeout=600s", timeout=660)
        wait_quiet([self.kuberay.activity, lambda: operator_activity(self.op)])
        said = ", ".join(f"{key} {value:.4g}" for key, value in measured.items())
        log(f"  {namespace}: {said}; cleared in {time.monotonic() - began:.0f} s")

    def ours(self) -> Measurement:
        ns = self.fresh_namespace("ours")
        api = self.kube.api
        rayjobs = Appearances(api, RAYJOBS, ns, child_added)
        statuses = Appearances(api, RLHFJOBS, ns, status_written)
        jobs = [tiny_job(f"job-{i}", ns) for i in range(self.n)]
        counted = api_requests(self.op)
        child, status = self.burst(jobs, rayjobs, statuses)
        # The later passes too (KubeRay's status on each RayJob brings one), not the deletion's.
        wait_quiet([self.kuberay.activity, lambda: operator_activity(self.op)])
        requests = per_job(counted, api_requests(self.op), self.n)
        measured = {**latency_figures(child, status), **operator_memory(self.op), **requests}
        self.clear(ns, measured)
        return measured

    def theirs(self) -> Measurement:
        ns = self.fresh_namespace("kuberay")
        api = self.kube.api
        clusters = Appearances(api, RAYCLUSTERS, ns, child_added)
        statuses = Appearances(api, RAYJOBS, ns, status_written)
        rayjobs = [plain_rayjob(f"job-{i}", ns) for i in range(self.n)]
        child, status = self.burst(rayjobs, clusters, statuses)
        measured = latency_figures(child, status)
        self.clear(ns, measured)
        return measured


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.operator.run", description=__doc__)
    parser.add_argument("--n", type=int, default=300, help="jobs created at once (300)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (3)")
    parser.add_argument("--workers", type=int, default=8, help="reconcile workers, each side (8)")
    parser.add_argument("--clutter", type=int, default=10_000,
                        help="unrelated pods, and as many ConfigMaps (10000)")  # fmt: skip
    args = parser.parse_args()
    with ControlPlane() as cp:
        filled = clutter.fill(cp, args.clutter)
        log(f"clutter: {filled}")
        with matched_kuberay(cp, args.workers) as kuberay:
            env = {"RLHF_OPERATOR_WORKERS": str(args.workers)}
            op = OperatorProcess(cp, "bench-operator", env=env).start()
            try:
                wait_quiet([kuberay.activity, lambda: operator_activity(op)])
                started = operator_memory(op)  # after its watches listed the clutter
                log(f"operator started: {started}")
                kube = Kube(clutter.admin_client(cp, CLIENT_THREADS + 4))  # and the watches
                bench = Bench(cp, op, kuberay, kube, args.n)
                runs = interleave({"ours": bench.ours, "kuberay": bench.theirs}, args.repeats)
            finally:
                op.stop()
    report(args, filled, started, figures(runs, compare))


def report(args: argparse.Namespace, filled: clutter.Clutter, started: dict[str, float],
           spreads: dict[str, Spread]) -> None:  # fmt: skip
    width = max(len(key) for key in spreads)
    print(f"{'figure':<{width}}  median (min-max) over {args.repeats} interleaved repeats")
    for key, spread in spreads.items():
        print(f"{key:<{width}}  {spread}")
    record = {
        "bench": "operator",
        "n": args.n,
        "repeats": args.repeats,
        "workers": args.workers,
        "clutter": {"pods": filled.pods, "configmaps": filled.configmaps},
        "operator_after_start": {key: round(value, 1) for key, value in started.items()},
        "figures": {key: spread.to_json() for key, spread in spreads.items()},
        # What `python -m bench` summarises.
        "sizes": [{"n": args.n, "ratio_p50": round(spreads["ratio_p50"].median, 3),
                   "ratio_p99": round(spreads["ratio_p99"].median, 3)}],
    }  # fmt: skip
    print(json.dumps(record), flush=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
