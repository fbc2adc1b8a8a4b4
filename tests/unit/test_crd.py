"""The CRD is generated from the models, committed, and a valid structural schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from rlhf_operator.api.crd import build_crd, render_crd_yaml
from rlhf_operator.api.reference import render_reference_markdown
from tests.unit.celcheck import default_errors

COMMITTED = Path(__file__).parents[2] / "crds" / "rlhfjobs.yaml"
VERSION = build_crd()["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from nodes(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from nodes(schema[key], f"{path}[{key}]")


def test_committed_crds_match_the_code() -> None:
    assert COMMITTED.read_text() == render_crd_yaml(), "run `make crds` and commit crds/"
    # One CRD: several replicas elect a leader through a Lease, not kopf's peering CRDs.
    assert [p.name for p in COMMITTED.parent.glob("*.yaml")] == [COMMITTED.name]


def test_committed_field_reference_matches_the_crd() -> None:
    reference = COMMITTED.parents[1] / "docs" / "reference" / "rlhfjob.md"
    assert reference.read_text() == render_reference_markdown(), (
        "run `make crds` and commit docs/reference/rlhfjob.md"
    )


def test_crd_identity() -> None:
    crd = yaml.safe_load(COMMITTED.read_text())
    assert crd["metadata"]["name"] == "rlhfjobs.rlhf.dev"
    assert crd["spec"]["names"]["shortNames"] == ["rlhf"]
    assert VERSION["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "Pools": ".status.poolsReady",
        "Step": ".status.training.step",
        "Age": ".metadata.creationTimestamp",
    }


@pytest.mark.parametrize(
    ("path", "node"), list(nodes(SCHEMA)), ids=lambda x: x if isinstance(x, str) else ""
)
def test_schema_is_structural(path: str, node: dict[str, Any]) -> None:
    assert "$ref" not in node and "$defs" not in node and "patternProperties" not in node
    if "anyOf" in node:
        assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf outside int-or-string"
        assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], (
            f"{path}: int-or-string branches hold only a type"
        )
    else:
        assert "type" in node or path == "", f"{path}: no type"
    assert not ("properties" in node and "additionalProperties" in node), path
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        assert node.get(bound, True) is True, f"{path}: {bound} must be a boolean in OpenAPI 3.0"


def test_every_field_is_described_for_kubectl_explain() -> None:
    # The affinity schema is Kubernetes' own (copied without descriptions); metadata at
    # the root must stay a bare object.
    missing = [
        p
        for p, n in nodes(SCHEMA)
        if p not in ("", ".metadata")
        and ".affinity." not in p
        and "[" not in p.rsplit(".", 1)[-1]
        and not n.get("description")
    ]
    assert missing == []


def test_pools_are_a_list_map_keyed_by_name() -> None:
    pools = SCHEMA["properties"]["spec"]["properties"]["pools"]
    assert pools["x-kubernetes-list-type"] == "map"
    assert pools["x-kubernetes-list-map-keys"] == ["name"]
    assert "name" in pools["items"]["required"]


def test_nested_sections_default_to_objects_so_the_server_fills_their_defaults() -> None:
    spec = SCHEMA["properties"]["spec"]["properties"]
    for section in ("algorithm", "generation", "trainer", "head"):
        assert spec[section]["default"] == {}
    assert spec["trainer"]["properties"]["batchSize"]["default"] == 64


def test_every_default_passes_the_rules_as_the_api_server_checks_it_at_creation() -> None:
    # A rule that reads a key the default lacks fails there, and the API server refuses
    # the whole CRD ("no such key"): every rule below a default must guard with has().
    assert default_errors(SCHEMA) == []


@pytest.mark.parametrize("rule", [r for _, n in nodes(SCHEMA) for r in n.get("x-kubernetes-validations", [])],
                         ids=lambda r: r["message"][:50])  # fmt: skip
def test_every_cel_rule_compiles(rule: dict[str, str]) -> None:
    celpy.Environment().compile(rule["rule"])
    assert rule["message"]
