"""Each example that puts its pools on node groups of their own, reconciled on the real
control plane (API server, scheduler, garbage collector, KubeRay, kwok GPU nodes): the
RayJob's groups, the real scheduler's placement, the status, KubeRay's submitter, the
garbage collection, and what the operator asked the API server for along the way.

Each test runs an operator of its own that watches only its namespace, so the requests
it counts are this job's alone. An operator of all namespaces also reconciles what
earlier tests left terminating in theirs, and reads from the API server the children
that went before it listed them: a CI run once counted 4 GETs of a ConfigMap that way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .harness import ControlPlane
from .jobs import CLUSTER_EXAMPLES, get, load, node_pools, status_when, worker_pods
from .operator_process import OperatorProcess
from .util import bound_claim, eventually


@pytest.fixture
def own_operator(controlplane: ControlPlane, namespace: str) -> Iterator[OperatorProcess]:
    """The operator as users run it, watching this test's namespace only (no operator
    of all namespaces runs while this module's tests do: each module stops its own)."""
    op = OperatorProcess(
        controlplane, "examples-operator", "--standalone", f"--namespace={namespace}"
    )
    yield op.start()
    op.stop()


@pytest.mark.slow
@pytest.mark.parametrize("example", CLUSTER_EXAMPLES, ids=lambda p: p.name)
def test_example_runs_each_pool_on_its_own_node_group(
    controlplane: ControlPlane, own_operator: OperatorProcess, namespace: str, example: Path
) -> None:
    cp, manifest = controlplane, load(example)
    name, spec = manifest["metadata"]["name"], manifest["spec"]
    pools = {p["name"]: p for p in spec["pools"]}
    if "checkpointClaim" in spec:  # bound first: the test cluster provisions no volumes
        claim = bound_claim(
            namespace, spec["checkpointClaim"], f"/tmp/{namespace}-ckpt", "ReadWriteMany"
        )
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(claim))
    cp.kubectl("apply", "-n", namespace, "-f", str(example))

    rayjob = eventually(lambda: get(cp, "rayjob", name, namespace), f"RayJob {name}")
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert {g["groupName"]: g["replicas"] for g in groups} == {
        n: p.get("replicas", 1) for n, p in pools.items()
    }

    cluster = eventually(lambda: (get(cp, "rayjob", name, namespace) or {}).get("status", {}).get("rayClusterName"),
                         "KubeRay to create the RayCluster")  # fmt: skip
    # KubeRay names the cluster in the RayJob's status a moment before it creates it.
    eventually(lambda: get(cp, "raycluster", cluster, namespace), f"RayCluster {cluster}")

    def all_workers_running() -> dict[str, list[dict[str, Any]]] | None:
        running = worker_pods(cp, name, namespace)
        done = all(len(running.get(n, [])) == p.get("replicas", 1) for n, p in pools.items())
        return running if done else None

    running = eventually(all_workers_running, "every pool's worker pods to run")
    where = node_pools(cp)
    nodes_by_pool = {
        pool: {pod["spec"]["nodeName"] for pod in pods} for pool, pods in running.items()
    }
    for pool, nodes in nodes_by_pool.items():  # the real scheduler honoured each pool's node group
        assert {where[n] for n in nodes} == {pools[pool]["nodeSelector"]["pool"]}, (pool, nodes)
    if spec.get("separation", "node") == "node":
        seen = [n for nodes in nodes_by_pool.values() for n in nodes]
        assert len(seen) == len(set(seen)), f"a node hosts two pools: {nodes_by_pool}"

    expected = f"{len(pools)}/{len(pools)}"
    status = eventually(
        lambda: status_when(cp, name, namespace, poolsReady=expected),
        f"status.poolsReady == {expected}",
    )
    for pool_status in status["pools"]:
        pool = pools[pool_status["name"]]
        assert (
            pool_status["desiredGPUs"]
            == pool_status["readyGPUs"]
            == pool.get("replicas", 1) * pool["gpusPerNode"]
        )
        assert set(pool_status["nodes"]) == nodes_by_pool[pool_status["name"]]
    assert status["rayJob"] == name and status["rayCluster"] == cluster
    # KubeRay submits the driver through the head Service's dashboard port: without it
    # the RayJob stays Initializing and no submitter is ever made.
    eventually(lambda: get(cp, "job", name, namespace), "KubeRay's submitter Job")
    # KubeRay writes the RayJob's status a moment after it makes the Job (seen on a
    # loaded machine: still Initializing when the Job was read).
    eventually(lambda: (get(cp, "rayjob", name, namespace) or {}).get("status", {})
               .get("jobDeploymentStatus") not in (None, "Initializing"),
               "the RayJob past Initializing")  # fmt: skip

    # From its creation to here, no deletion: a new job's first reconcile asks for
    # nothing before its creates (its RayJob is not there unless this operator made it;
    # it was a GET of the RayJob and one of the job), and no later one reads either.
    running_counts = requests_made(own_operator)
    assert running_counts.get("get RayJob", 0) == 0, running_counts
    assert running_counts.get("get RLHFJob", 0) == 0, running_counts

    cp.kubectl("delete", "rlhfjob", name, "-n", namespace, "--wait=true")
    eventually(lambda: get(cp, "rayjob", name, namespace) is None and not worker_pods(cp, name, namespace),
               "garbage collection of the RayJob and its pods")  # fmt: skip
    assert_reads_come_from_the_watches(own_operator)


def requests_made(operator: OperatorProcess) -> dict[str, int]:
    """The operator's requests to the API server so far, by "verb Kind"."""
    made = operator.metrics("rlhf_operator_api_requests_total")
    return {f"{s['verb']} {s['kind']}": int(v) for s, v in made}


def assert_reads_come_from_the_watches(operator: OperatorProcess) -> None:
    """Its pods went Running and were deleted: many reconciles, and not one LIST of pods
    (a reconcile used to LIST a job's pods, and GET each child, at every event)."""
    counts = requests_made(operator)  # in a failure's message

    def requests(verb: str, kind: str) -> float:
        return counts.get(f"{verb} {kind}", 0)

    assert operator.metric("rlhf_operator_reconcile_duration_seconds_count") >= 10
    assert requests("create", "RayJob") == 1, counts  # requests are counted
    assert requests("list", "Pod") == 0, counts
    # This operator made every child and stored each as made: a child is read from the
    # API server only by a reconcile under way as the garbage collector took it.
    assert requests("get", "ConfigMap") <= 1, counts
    assert requests("get", "RayJob") <= 1, counts
    # Once the job is gone from the cache, it is read by at most three reconciles of its
    # key (workqueue.py): the one under way, the one queued again behind it, and a
    # delayed look (seen: 3 on a loaded machine, with a read before the RayJob that a
    # new job no longer makes). Its children's going brings no reconcile (it was one
    # GET of the job each, about 15 a job).
    assert requests("get", "RLHFJob") <= 3, counts
