"""The field reference (rlhfjob crd --reference) lists every field and CEL rule of the CRD."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rlhf_operator.api.reference import openapi_schema, render_reference_markdown
from rlhf_operator.app.cli import main

PAGE = render_reference_markdown()


def schema_paths(schema: dict[str, Any], path: str) -> Iterator[str]:
    for name, sub in schema.get("properties", {}).items():
        yield f"{path}.{name}"
        while sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            sub, name = sub["items"], name + "[]"
        if name != "affinity":  # Kubernetes' own type, listed as one field
            yield from schema_paths(sub, f"{path}.{name}")


def cel_rules(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "x-kubernetes-validations":
                yield from (found["rule"] for found in value)
            elif key != "affinity":
                yield from cel_rules(value)


def test_every_field_has_a_row() -> None:
    root = openapi_schema()
    paths = [p for top in ("spec", "status") for p in schema_paths(root["properties"][top], top)]
    assert len(paths) > 200
    missing = [p for p in paths if f"| `{p}` |" not in PAGE]
    assert missing == []


def test_every_cel_rule_is_shown() -> None:
    missing = [rule for rule in cel_rules(openapi_schema()) if f"`{rule}`" not in PAGE]
    assert missing == []


def test_a_row_gives_type_default_rules_and_description() -> None:
    row = next(line for line in PAGE.splitlines() if line.startswith("| `spec.pools[].replicas`"))
    assert row == "| `spec.pools[].replicas` | integer | `1` | ≥ 1, ≤ 512 | Nodes in this pool. |"
    enum = next(line for line in PAGE.splitlines() if line.startswith("| `spec.separation`"))
    assert "one of `node`, `gpu`" in enum


def test_the_cli_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd", "--reference"]) == 0
    assert capsys.readouterr().out == PAGE
