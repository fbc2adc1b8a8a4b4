"""Spec models with cross-field rules written once, in Python and in CEL side by side.

A model lists its `rules`. pydantic checks the Python side whenever the model is
validated (the CLI, the operator, the trainer reading its spec); the CRD generator
emits the CEL side as `x-kubernetes-validations`, so the API server rejects the same
specs at admission. tests/unit/test_properties.py holds the two sides to agreement.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict


@dataclass(frozen=True)
class Rule:
    """One cross-field rule over a model instance (`self` in CEL)."""

    field: str  # camelCase path below the model ("roles.actor"), "" for the model itself
    message: str  # shown by both validators, so it must read well without context
    cel: str  # the rule as the API server evaluates it
    holds: Callable[[Any], bool]  # the same rule in Python
    detail: Callable[[Any], str] | None = None  # Python only: the values that broke it

    def explain(self, model: Any) -> str:
        return f"{self.message} ({self.detail(model)})" if self.detail else self.message


@dataclass(frozen=True)
class FieldError:
    """A validation error at a dotted field path, e.g. `spec.pools[1].gpusPerNode`."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class RuleViolations(ValueError):
    """Raised inside validation; carries each broken rule so its field path survives."""

    def __init__(self, broken: list[tuple[Rule, str]]) -> None:
        super().__init__("; ".join(f"{rule.field or '.'}: {text}" for rule, text in broken))
        self.broken = broken


def _schema_extra(schema: JsonDict, model: type[Any]) -> None:
    """Per-model JSON schema additions for the CRD: CEL rules, descriptions, defaults."""
    properties: Any = schema.get("properties", {})
    for name, field in model.model_fields.items():
        prop = properties.get(field.alias or name)
        if prop is None:
            continue
        if field.description:  # pydantic drops it beside some $refs
            prop["description"] = field.description
        factory = field.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            # An object default of {} makes the API server fill in the nested defaults.
            prop["default"] = {}
    if model.rules:
        schema["x-kubernetes-validations"] = [
            {"rule": r.cel, "message": r.message}
            | ({"fieldPath": f".{r.field}"} if r.field else {})
            for r in model.rules
        ]


class SpecModel(BaseModel):
    """Base of every spec model: camelCase on the wire, unknown fields rejected, rules checked."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        json_schema_extra=_schema_extra,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        broken = [(rule, rule.explain(self)) for rule in self.rules if not rule.holds(self)]
        if broken:
            raise RuleViolations(broken)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


Loc = tuple[str | int, ...]


def dotted(loc: Loc) -> str:
    """("spec", "pools", 1, "name") -> "spec.pools[1].name"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def field_errors(error: ValidationError, prefix: Loc = ()) -> list[FieldError]:
    """Flatten a pydantic error into field-pathed messages a user can act on."""
    found: list[FieldError] = []
    for item in error.errors(include_url=False):
        loc = prefix + tuple(_real_loc(item["loc"]))
        cause = (item.get("ctx") or {}).get("error")
        if isinstance(cause, RuleViolations):
            for rule, text in cause.broken:
                rule_loc = tuple(rule.field.split(".")) if rule.field else ()
                found.append(FieldError(dotted(loc + rule_loc), text))
        else:
            found.append(FieldError(dotted(loc), _describe(item)))
    return found


# pydantic adds validator steps ("function-after[...]", "[key]") and the tried members
# of a union ("int", "str") to an error's location; they are not fields the user wrote.
_NOT_A_FIELD = re.compile(r"^([\w-]*\[.*\]|int|str|float|bool|none|list|dict)$")


def _real_loc(loc: tuple[Any, ...]) -> list[str | int]:
    return [p for p in loc if isinstance(p, int) or not _NOT_A_FIELD.match(p)]


def _describe(item: Any) -> str:
    kind = item["type"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; fields are camelCase)"
    message = str(item["msg"]).removeprefix("Value error, ")
    if isinstance(item["input"], dict | list):
        return message
    got = repr(item["input"])
    return f"{message} (got {got[:60]}{'…' if len(got) > 60 else ''})"
