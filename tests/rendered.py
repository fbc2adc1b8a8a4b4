"""Reading the operator's rendered children in tests: objects by kind and name, the
labels of every pod template, and label selectors matched as the API server does."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    [found] = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    tests = {
        "In": lambda e: labels.get(e["key"]) in e["values"],
        "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
        "Exists": lambda e: e["key"] in labels,
        "DoesNotExist": lambda e: e["key"] not in labels,
    }
    return all(tests[e["operator"]](e) for e in selector.get("matchExpressions", []))


def pod_labels(objects: list[Obj]) -> dict[str, dict[str, str]]:
    """The labels of every pod template: the RayJob's head, each pool and its submitter
    by role, each Deployment (an environment's, an agent's) by its name."""
    rayjob = of_kind(objects, "RayJob")[0]["spec"]
    cluster = rayjob["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates |= {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    templates["submitter"] = rayjob["submitterPodTemplate"]
    templates |= {
        d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(objects, "Deployment")
    }
    return {name: t["metadata"]["labels"] for name, t in templates.items()}
