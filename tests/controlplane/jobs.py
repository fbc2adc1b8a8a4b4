"""RLHFJobs and their children through kubectl: the helpers that the operator's
control-plane tests share."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import skip_or_fail

from . import demo
from .harness import REPO_ROOT, ControlPlane
from .operator_process import OperatorProcess
from .util import bound_claim, eventually, get_json, rlhfjob

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))
# local-cpu targets a laptop (one logical GPU, no tolerations); the GPU nodes are tainted.
# cpu-cluster trains for real on the real node (test_real_job.py).
# The examples that put each pool on a node group of its own (the others run on this
# machine: locally, or on the tests' real node).
CLUSTER_EXAMPLES = [
    p for p in EXAMPLES
    if p.name not in ("local-cpu.yaml", "cpu-cluster.yaml", "agentic-cluster.yaml", "agentic-tools.yaml")
]  # fmt: skip


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def apply(cp: ControlPlane, namespace: str, manifest: dict[str, Any], check: bool = True) -> Any:
    return cp.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=check
    )


def apply_example(cp: ControlPlane, namespace: str, file_name: str) -> None:
    cp.kubectl("apply", "-n", namespace, "-f", str(REPO_ROOT / "examples" / file_name))


def patch_job(
    cp: ControlPlane, namespace: str, name: str, kind: str, patch: str, check: bool = True
) -> Any:
    """kubectl patch --type=KIND of an RLHFJob."""
    return cp.kubectl(
        "patch", "rlhfjob", name, "-n", namespace, f"--type={kind}", "-p", patch, check=check
    )


def get(cp: ControlPlane, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    result = cp.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def job_status(cp: ControlPlane, name: str, namespace: str) -> dict[str, Any]:
    return (rlhfjob(cp, name, namespace) or {}).get("status") or {}


def worker_pods(cp: ControlPlane, job: str, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """Running worker pods of a job, by pool."""
    pods = get_json(cp, "pods", "-n", namespace, "-l", f"rlhf.dev/job={job},rlhf.dev/pool")["items"]
    by_pool: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        if pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"):
            by_pool.setdefault(pod["metadata"]["labels"]["rlhf.dev/pool"], []).append(pod)
    return by_pool


def status_when(
    cp: ControlPlane, name: str, namespace: str, **expected: Any
) -> dict[str, Any] | None:
    """The job's status once the given fields have the given values, else None."""
    status = job_status(cp, name, namespace)
    return status if all(status.get(k) == v for k, v in expected.items()) else None


def recreated(
    cp: ControlPlane, kind: str, name: str, namespace: str, old_uid: str
) -> dict[str, Any] | None:
    obj = get(cp, kind, name, namespace)
    return obj if obj and obj["metadata"]["uid"] != old_uid else None


def apply_with_checkpoints(cp: ControlPlane, namespace: str, example: str) -> None:
    """Apply an example that keeps checkpoints, on a bound `checkpoints` claim (a resize
    may then replace its attempt)."""
    claim = bound_claim(namespace, "checkpoints", f"/tmp/{namespace}-ckpt", "ReadWriteMany")
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(claim))
    manifest = load(REPO_ROOT / "examples" / example)
    manifest["spec"]["checkpointClaim"] = "checkpoints"
    apply(cp, namespace, manifest)


def node_pools(cp: ControlPlane) -> dict[str, str]:
    """kwok's nodes by pool (the real node, where it runs, is in none)."""
    return {
        n["metadata"]["name"]: n["metadata"]["labels"]["pool"]
        for n in get_json(cp, "nodes", "-l", "type=kwok")["items"]
    }


@contextmanager
def real_node_job(
    cp: ControlPlane, namespace: str, manifest: dict[str, Any], operator: str
) -> Iterator[str]:
    """MANIFEST applied in NAMESPACE, a namespace whose pods run on the tests' real node
    (the trainer's and the environment's images loaded into its containerd), and run by an
    operator of its own (standalone, NAMESPACE only) named OPERATOR; the job's name.
    Skips (fails, in CI) without a real node. On the way out the job is deleted and the
    operator stopped."""
    if cp.real_node is None:
        skip_or_fail(f"no real node: {cp.real_node_absent}")
    demo.load_images(cp.real_node, ("trainer-cpu", "environment"))
    demo.real_node_namespace(cp, namespace)
    process = OperatorProcess(cp, operator, "--standalone", f"--namespace={namespace}")
    process.start()
    name: str = manifest["metadata"]["name"]
    try:
        apply(cp, namespace, manifest)
        yield name
    finally:
        cp.kubectl("delete", "rlhfjob", name, "-n", namespace, "--wait=false", check=False)
        process.stop()


@dataclass
class Polled:
    """What poll_to_the_end records of a job: its conditions once it reported its first
    step, and its status at the end."""

    conditions_at_first_step: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


def poll_to_the_end(
    cp: ControlPlane,
    name: str,
    namespace: str,
    polled: Polled,
    at_first_step: Callable[[dict[str, Any]], object] = lambda status: None,
    each_poll: Callable[[dict[str, Any]], object] = lambda status: None,
    timeout: float = 900,
) -> None:
    """Poll the job's status to its end (Succeeded or Failed), recorded in `polled`. On
    the way: at_first_step with the status once a first step is reported (an event to act
    on, or to read the job at), and each_poll with every status polled (at 2 Hz: some
    steps, not all)."""

    def status() -> dict[str, Any]:
        now = job_status(cp, name, namespace)
        each_poll(now)
        return now

    eventually(lambda: (status().get("training") or {}).get("step"), "the first step", timeout)
    first = job_status(cp, name, namespace)
    polled.conditions_at_first_step = first["conditions"]
    at_first_step(first)
    eventually(lambda: status().get("phase") in ("Succeeded", "Failed"), "the end", timeout)
    polled.status = job_status(cp, name, namespace)
