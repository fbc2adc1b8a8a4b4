"""examples/agentic-cluster.yaml schedules on `make cluster`'s node as written (issue 72,
item 10): the CPU every one of its pods asks for, as the operator renders them (head,
workers, KubeRay's submitter, the environment's replicas) and the chart's operator pod
beside them, within the node's capacity.

The real node's capacity is the machine's cores (tests/controlplane/test_node.py); the
machines `make cluster` runs on here and in CI have 2, and the walk-through says so
(docs/getting-started/cluster.md)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_operator.api.validation import parse_job
from rlhf_operator.render.children import JobRef, render_children
from tests.unit.conftest import EXAMPLES, load

Obj = dict[str, Any]
NODE_MILLICORES = 2000  # `make cluster`'s one real node
CHART_VALUES = Path(__file__).parents[2] / "charts" / "rlhf-operator" / "values.yaml"
# The examples that say they run on `make cluster`'s node, with the operator there too.
ON_MAKE_CLUSTER = ("agentic-cluster.yaml", "cpu-cluster.yaml")


def millicores(quantity: str | int) -> int:
    text = str(quantity)
    if text.endswith("m"):
        return int(text[:-1])
    return int(Decimal(text) * 1000)


def cpu_request(template: Obj) -> int:
    return sum(
        millicores(c.get("resources", {}).get("requests", {}).get("cpu", 0))
        for c in template["spec"]["containers"]
    )


def pods_cpu(objects: list[Obj]) -> dict[str, int]:
    """Each pod (by a name of its own) and the CPU it requests, in millicores."""
    found: dict[str, int] = {}
    for obj in objects:
        if obj["kind"] == "RayJob":
            spec = obj["spec"]
            cluster = spec["rayClusterSpec"]
            found["head"] = cpu_request(cluster["headGroupSpec"]["template"])
            for group in cluster["workerGroupSpecs"]:
                for i in range(group["replicas"] * group["numOfHosts"]):
                    found[f"{group['groupName']}-{i}"] = cpu_request(group["template"])
            found["submitter"] = cpu_request(spec["submitterPodTemplate"])
        elif obj["kind"] == "Deployment":
            for i in range(obj["spec"]["replicas"]):
                found[f"{obj['metadata']['name']}-{i}"] = cpu_request(obj["spec"]["template"])
    return found


def operator_cpu() -> int:
    values = yaml.safe_load(CHART_VALUES.read_text())
    return millicores(values["resources"]["requests"]["cpu"])


def example_cpu(name: str, replicas: int | None = None) -> dict[str, int]:
    manifest = load(EXAMPLES[0].parent / name)
    if replicas is not None:
        manifest["spec"]["environments"][0]["replicas"] = replicas
    job = parse_job(manifest)
    ref = JobRef(job.metadata.name, "demo", uid="uid")
    return pods_cpu(render_children(ref, job.spec)) | {"operator": operator_cpu()}


@pytest.mark.parametrize("name", ON_MAKE_CLUSTER)
def test_the_example_as_written_fits_make_clusters_node_beside_the_operator(name: str) -> None:
    asked = example_cpu(name)
    assert {"head", "submitter", "operator"} <= set(asked), asked
    assert sum(asked.values()) <= NODE_MILLICORES, asked


def test_every_pod_of_the_agentic_example_is_counted_and_a_second_replica_fits() -> None:
    """Its one environment in two replicas, as tests/controlplane/test_agentic_node.py
    runs it, still fits: the operator runs beside it there as a process, here counted."""
    asked = example_cpu("agentic-cluster.yaml")
    assert set(asked) == {"head", "policy-0", "value-0", "submitter",
                          "agentic-cluster-env-lookup-0", "operator"}  # fmt: skip
    assert sum(asked.values()) == 1900, asked
    assert sum(example_cpu("agentic-cluster.yaml", replicas=2).values()) <= NODE_MILLICORES


def test_quantities_are_read_as_the_api_server_does() -> None:
    assert [millicores(q) for q in ("800m", "1", "1.5", 2, "0")] == [800, 1000, 1500, 2000, 0]
