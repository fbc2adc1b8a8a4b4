"""Evaluate a CRD's CEL rules the way the API server does, for tests without a cluster.

The API server first applies schema defaults, then evaluates every
`x-kubernetes-validations` rule with `self` bound to the node that declares it, a
property named as a CEL reserved word escaped (`function` is `self.__function__`).
(The control-plane tests check the same rules on a real API server.)
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import celpy

from rlhf_operator.api.crd import build_crd


def crd_schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(
    obj: Any, old: Any = None, schema: dict[str, Any] | None = None
) -> list[tuple[str, str]]:
    """(field path, message) for every rule that fails on `obj` after defaulting; with
    `old`, as an update of `old` (transition rules on oldSelf run too)."""
    schema = schema or crd_schema()
    found: list[tuple[str, str]] = []
    old = None if old is None else apply_defaults(schema, copy.deepcopy(old))
    _walk(schema, apply_defaults(schema, copy.deepcopy(obj)), old, "", found)
    return [(path.lstrip("."), message) for path, message in found]


def assert_refused(job: dict[str, Any], path: str, words: str, cel_too: bool) -> None:
    """Admission refuses `job` with an error at `path` saying `words`; and, with
    `cel_too`, so do the CRD's CEL rules (what the API server checks before any webhook)."""
    from rlhf_operator.api.validation import InvalidJob, parse_job

    try:
        parse_job(job)
    except InvalidJob as refused:
        errors = refused.errors
    else:
        raise AssertionError(f"accepted; expected an error at {path} saying {words!r}")
    matching = [e for e in errors if e.path == path and words in e.message]
    assert matching, f"no error at {path} saying {words!r}: {errors}"
    if cel_too:
        assert any(p == path for p, _ in cel_errors(job)), cel_errors(job)


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    elif schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # the API server reads `number` fields as doubles
    return value


def default_errors(schema: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    """(field path, message) for every rule that fails on a default of the schema, as the
    API server checks each default when the CRD is created: as written, its own nested
    defaults not applied (an object default of {} lacks every key)."""
    found: list[tuple[str, str]] = []
    for name, sub in schema.get("properties", {}).items():
        if "default" in sub:
            _walk(sub, copy.deepcopy(sub["default"]), None, f"{path}.{name}", found)
        found += default_errors(sub, f"{path}.{name}")
    return found


_MISSING = object()


def _walk(
    schema: dict[str, Any], value: Any, old: Any, path: str, found: list[tuple[str, str]]
) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and (old is _MISSING or old is None):
            continue  # transition rules run on updates, where the old value exists
        bindings = {"self": celpy.json_to_cel(_escaped(schema, value))}
        if transition:
            bindings["oldSelf"] = celpy.json_to_cel(_escaped(schema, old))
        try:
            ok = _program(rule["rule"]).evaluate(bindings)
        except Exception as error:  # an evaluation error rejects the object too
            ok = error
        if ok is not True and not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
            found.append((path + rule.get("fieldPath", ""), rule["message"]))
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                old_value = old.get(name, _MISSING) if isinstance(old, dict) else _MISSING
                _walk(sub, value[name], old_value, f"{path}.{name}", found)
    elif isinstance(value, list) and "items" in schema:
        keys = schema.get("x-kubernetes-list-map-keys")
        for index, item in enumerate(value):
            _walk(schema["items"], item, _correlated(item, old, keys), f"{path}[{index}]", found)


# CEL's reserved words: the API server names a property spelled as one `__word__`.
CEL_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else",
                "for", "function", "if", "import", "let", "loop", "package", "namespace",
                "return", "var", "void", "while"}  # fmt: skip


def _escaped(schema: dict[str, Any], value: Any) -> Any:
    """`value` with its properties named as CEL sees them (`function` -> `__function__`)."""
    properties = schema.get("properties")
    if isinstance(value, dict) and properties:
        return {
            (f"__{key}__" if key in CEL_RESERVED else key): _escaped(properties.get(key, {}), v)
            for key, v in value.items()
        }
    if isinstance(value, list) and "items" in schema:
        return [_escaped(schema["items"], v) for v in value]
    return value


def _correlated(item: Any, old: Any, keys: list[str] | None) -> Any:
    """The old list item an item is compared with: the one with the same map keys."""
    if not keys or not isinstance(old, list) or not isinstance(item, dict):
        return _MISSING
    key = [item.get(k) for k in keys]
    return next(
        (o for o in old if isinstance(o, dict) and [o.get(k) for k in keys] == key), _MISSING
    )
