"""Whether the installed KubeRay can run the RayJobs the operator renders.

The rendered RayJob uses fields only newer KubeRay CRDs declare (a worker group's
`resources` and `labels`, which pin pools to Ray nodes): an older CRD makes the API
server drop them without a word, and the trainer then waits for pools that no Ray node
carries. KubeRay 1.5 declares them but probes pods with wget, which the trainer image
lacks. So the operator reads the installed RayJob CRD and, rather than start a job it
would break, says why in the job's status and events.

And, where KubeRay's verdict on an attempt came late, the operator asks the attempt's
head how its Ray job ended, as KubeRay does (`ask_head`).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from rlhf_operator.controller.kube import Kube, Obj

log = logging.getLogger(__name__)

MINIMUM_VERSION = "1.6"
# How long a reconcile waits for a Ray head's answer (how a Ray job ended): one worker's.
HEAD_TIMEOUT_SECONDS = 3
RAYJOB_CRD = "rayjobs.ray.io"
RAYJOB_VERSION = "v1"
# A field KubeRay added to the RayJob CRD in 1.6 (1.5 and older lack it): the CRD carries
# no version number, and no field the operator renders tells 1.5 from 1.6.
SINCE_MINIMUM = ("spec", "preRunningDeadlineSeconds")
# How old the CRD read a new attempt is checked against may be: KubeRay may be upgraded,
# or its CRD replaced by an older one, while the operator runs. A new attempt asks
# (problem), so a burst of new jobs costs one read, not one each.
RECHECK_SECONDS = 60.0


def pruned_fields(schema: Obj, value: Any, path: str = "") -> list[str]:
    """The fields of `value` that `schema` does not declare: the API server would prune
    them silently."""
    if isinstance(value, list) and "items" in schema:
        items = schema["items"]
        return [f for i, v in enumerate(value) for f in pruned_fields(items, v, f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    declared = schema.get("properties")
    if declared is None:  # a map: every value has the same schema, if any
        extra = schema.get("additionalProperties")
        if not isinstance(extra, dict):
            return []
        return [f for k, v in value.items() for f in pruned_fields(extra, v, f"{path}.{k}")]
    found = []
    for key, item in value.items():
        if key in declared:
            found += pruned_fields(declared[key], item, f"{path}.{key}")
        elif key not in ("apiVersion", "kind", "metadata"):
            found.append(f"{path}.{key}")
    return found


def served_schema(crd: Obj, version: str = RAYJOB_VERSION) -> Obj | None:
    for served in crd.get("spec", {}).get("versions", []):
        if served.get("name") == version and served.get("served"):
            schema: Obj = served.get("schema", {}).get("openAPIV3Schema", {})
            return schema
    return None


def incompatibility(crd: Obj | None, rayjob: Obj) -> str | None:
    """Why the KubeRay whose RayJob CRD is `crd` (None: not installed) cannot run the
    rendered `rayjob`; None when it can."""
    need = f"KubeRay >= {MINIMUM_VERSION} is needed"
    if crd is None:
        return f"KubeRay is not installed (no CustomResourceDefinition {RAYJOB_CRD}): {need}"
    schema = served_schema(crd)
    if schema is None:
        return f"the installed KubeRay does not serve RayJob {RAYJOB_VERSION}: {need}"
    dropped = pruned_fields(schema, rayjob)
    if dropped:
        shown = ", ".join(dropped[:4]) + (
            f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
        )
        return (
            f"the installed KubeRay's RayJob CRD lacks fields this job needs, which the API "
            f"server would drop: {shown}; {need}"
        )
    node = schema
    for key in SINCE_MINIMUM:
        node = node.get("properties", {}).get(key)
        if node is None:
            return (
                f"the installed KubeRay is older than {MINIMUM_VERSION} (its RayJob CRD has no "
                f"{'.'.join(SINCE_MINIMUM)}); its probes run wget, which the trainer image "
                f"lacks, so pods would never be ready: {need}"
            )
    return None


class KubeRayCheck:
    """The installed RayJob CRD, read at the first check and again at a check once the
    last read is RECHECK_SECONDS old."""

    def __init__(self, kube: Kube, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.clock = clock
        self._crd: Obj | None = None
        self._read_at: float | None = None
        self._unreadable = False  # no permission to read it: not checked

    def refresh(self) -> None:
        try:
            self._crd = self.kube.get("CustomResourceDefinition", "", RAYJOB_CRD)
            self._unreadable = False
        except ApiException as error:
            if error.status != 403:
                raise
            if not self._unreadable:  # say it once, not at every reconcile
                log.warning("cannot read CRD %s (%s): KubeRay's version is not checked",
                            RAYJOB_CRD, error.reason)  # fmt: skip
            self._unreadable = True
        self._read_at = self.clock()

    def problem(self, rayjob: Obj) -> str | None:
        """Why this rendered RayJob cannot run on the installed KubeRay, or None."""
        if self._read_at is None or self.clock() - self._read_at >= RECHECK_SECONDS:
            self.refresh()
        return None if self._unreadable else incompatibility(self._crd, rayjob)


def ask_head(url: str) -> dict[str, Any]:
    """GET `url` of a Ray head's job API (what KubeRay asks how a Ray job ended): its
    JSON answer. OSError when the head cannot be reached, ValueError if not JSON."""
    with urllib.request.urlopen(url, timeout=HEAD_TIMEOUT_SECONDS) as response:
        answer = json.loads(response.read())
    if not isinstance(answer, dict):
        raise ValueError(f"{url} answered {answer!r}")
    return answer
