"""Small helpers shared by the control-plane tests."""

from __future__ import annotations

import functools
import json
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client

from rlhf_operator.api.job import GROUP, PLURAL, VERSION

from .harness import BIN_DIR, REPO_ROOT, ControlPlane

WAIT = 90  # seconds; generous because a 2-core machine may be busy
T = TypeVar("T")


def eventually(fn: Callable[[], T], what: str, timeout: float = WAIT) -> T:
    """Poll fn until it returns something truthy; fail with `what` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; last value: {last!r}")


@functools.cache
def _custom_objects(kubeconfig: str) -> client.CustomObjectsApi:
    from kubernetes import config

    return client.CustomObjectsApi(config.new_client_from_config(config_file=kubeconfig))


def rlhfjob(cp: ControlPlane, name: str, namespace: str) -> dict[str, Any] | None:
    """The RLHFJob as the API server has it, None if there is none. Read in-process: the
    tests poll a job's status every half second for many minutes, and a kubectl process
    costs ~0.1 CPU-s each time (a few hundred CPU-s over the tier)."""
    try:
        job: dict[str, Any] = _custom_objects(str(cp.kubeconfig)).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except client.ApiException as error:
        if error.status == 404:
            return None
        raise
    return job


def get_json(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl("get", *args, "-o", "json").stdout)


def kubectl_as(cp: ControlPlane, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    """kubectl authenticated only by a bearer token (no admin certificate)."""
    argv = [str(BIN_DIR / "kubectl"), "--kubeconfig=/dev/null", f"--server={cp.server}",
            f"--certificate-authority={cp.ca_file}", f"--token={token}", *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


EXAMPLES_DIR = REPO_ROOT / "examples"
CLAIM_LABEL = "rlhf-test/namespace"


def example_claims() -> list[str]:
    """Every PersistentVolumeClaim the examples mount (models, prompts)."""
    return sorted(
        {
            volume["persistentVolumeClaim"]["claimName"]
            for path in EXAMPLES_DIR.glob("*.yaml")
            for volume in (yaml.safe_load(path.read_text())["spec"].get("pods") or {}).get(
                "volumes", []
            )
            if "persistentVolumeClaim" in volume
        }
    )


def bound_claim(namespace: str, claim: str, path: str, access: str) -> list[dict[str, Any]]:
    """A PersistentVolumeClaim and the hostPath volume made for it (named
    `<namespace>-<claim>`, labelled with its namespace): the test cluster has no storage
    provisioner, and a pod whose claim is unbound never schedules."""
    volume = f"{namespace}-{claim}"
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": volume, "labels": {CLAIM_LABEL: namespace}},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [access],
                  "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                  "hostPath": {"path": path}, "claimRef": {"namespace": namespace, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": claim, "namespace": namespace},
         "spec": {"accessModes": [access], "storageClassName": "", "volumeName": volume,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]  # fmt: skip


def provide_example_claims(cp: ControlPlane, namespace: str) -> None:
    """The examples' claims in `namespace`, each bound to a volume made for it."""
    objects = [
        o
        for claim in example_claims()
        for o in bound_claim(namespace, claim, f"/tmp/{namespace}-{claim}", "ReadOnlyMany")
    ]
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))


def remove_example_claims(cp: ControlPlane, namespace: str) -> None:
    """The volumes provide_example_claims made for `namespace` (the claims go with it)."""
    cp.kubectl("delete", "pv", "-l", f"{CLAIM_LABEL}={namespace}", "--wait=false", check=False)
