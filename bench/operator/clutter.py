"""Objects that are none of the operator's business, as a real cluster is full of them.

An operator that watches every pod and ConfigMap pays for each in memory and CPU, even
if its handlers ignore them. The pods carry a scheduling gate, so kube-scheduler and
kwok leave them Pending and untouched: the API server alone serves them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config

from rlhf_operator.controller.kube import Kube
from tests.controlplane.harness import ControlPlane

NAMESPACES = 10
THREADS = 16  # concurrent creates: the API server, not this client, should be the bound


@dataclass(frozen=True)
class Clutter:
    pods: int
    configmaps: int
    seconds: float  # to create them all


def app_pod(name: str, namespace: str) -> dict[str, Any]:
    """A plain application pod, about the size of a Deployment's (2-3 kB once defaulted)."""
    labels = {"app": "shop", "tier": "web", "pod-template-hash": "5d8f7c6b9"}
    container = {
        "name": "web",
        "image": "registry.example/shop/web:1.4.2",
        "ports": [{"containerPort": 8080, "name": "http"}],
        "env": [{"name": f"SETTING_{i}", "value": f"value-{i}"} for i in range(8)],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [container], "schedulingGates": [{"name": "bench/held"}]},
    }


def app_configmap(name: str, namespace: str) -> dict[str, Any]:
    """An application's settings: 1 kB of data."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "shop"}},
        "data": {"settings.ini": "key = value\n" * 85},
    }


def admin_client(cp: ControlPlane, connections: int) -> client.ApiClient:
    """A client that keeps one connection per calling thread."""
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(cp.kubeconfig), client_configuration=configuration
    )
    configuration.connection_pool_maxsize = connections
    return client.ApiClient(configuration)


def fill(cp: ControlPlane, count: int) -> Clutter:
    """`count` pods and `count` ConfigMaps, spread over NAMESPACES namespaces."""
    namespaces = [f"clutter-{i}" for i in range(NAMESPACES)]
    for namespace in namespaces:
        cp.create_namespace(namespace)
    kube = Kube(admin_client(cp, THREADS))

    def create(i: int) -> None:
        namespace = namespaces[i % NAMESPACES]
        kube.create(app_pod(f"web-{i}", namespace))
        kube.create(app_configmap(f"settings-{i}", namespace))

    began = time.monotonic()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(create, range(count)))
    return Clutter(count, count, round(time.monotonic() - began, 1))
