"""A small synchronous Kubernetes REST layer over the official client's ApiClient.

Objects are plain dicts (what rendering produces); a `Kind` knows its URL. Keeping one
generic get/create/patch/list lets the reconciler treat every child alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from rlhf_operator.api.job import API_VERSION, PLURAL

Obj = dict[str, Any]
Objs = list[Obj]  # named out here: inside Kube, `list` is its method


@dataclass(frozen=True)
class Kind:
    api_version: str  # "v1", "ray.io/v1", ...
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        """`namespace` "" for a cluster-scoped kind."""
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        scope = ["namespaces", namespace] if namespace else []
        parts = [root, *scope, self.plural, name, subresource]
        return "/".join(p for p in parts if p)


KINDS = {
    "ConfigMap": Kind("v1", "configmaps"),
    "ServiceAccount": Kind("v1", "serviceaccounts"),
    "Pod": Kind("v1", "pods"),
    "Event": Kind("v1", "events"),
    "Role": Kind("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "Service": Kind("v1", "services"),
    "Deployment": Kind("apps/v1", "deployments"),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets"),
    "RayJob": Kind("ray.io/v1", "rayjobs"),
    "RayCluster": Kind("ray.io/v1", "rayclusters"),
    "RLHFJob": Kind(API_VERSION, PLURAL),
    "Workload": Kind("kueue.x-k8s.io/v1beta2", "workloads"),
    "CustomResourceDefinition": Kind("apiextensions.k8s.io/v1", "customresourcedefinitions"),
    "Lease": Kind("coordination.k8s.io/v1", "leases"),  # leader election (leader.py)
}

# What the operator asks of the API server, by verb and kind: reads are answered from the
# watches' cache (cache.py), so per-event GETs and LISTs show up here as a regression.
REQUESTS = Counter(
    "rlhf_operator_api_requests_total",
    "Requests the operator made to the Kubernetes API server",
    ["verb", "kind"],
)

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def load_config(connections: int) -> client.ApiClient:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config.
    `connections`: how many threads may call at once, each of which keeps one (the
    default, 5 per CPU, dropped connections under a burst of new jobs, and each new
    one costs the API server a TLS handshake)."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = connections
    return client.ApiClient(configuration)


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Obj:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )  # fmt: skip
        response = self.api.call_api(*request, _request_timeout=30)
        response.read()  # type: ignore[no-untyped-call]
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        data: Obj = json.loads(response.data or b"{}")
        return data

    def reachable(self) -> bool:
        """Whether the API server answers its readiness endpoint."""
        request = self.api.param_serialize("GET", "/readyz", auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(*request, _request_timeout=5)
        except Exception:  # connection refused, TLS, timeout: all mean "not reachable"
            return False
        return bool(response.status == 200)

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        REQUESTS.labels("get", kind).inc()
        try:
            return self._call("GET", KINDS[kind].path(namespace, name))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def read(self, kind: str, namespace: str, name: str) -> Obj | None:
        """`get`, from the API server itself: a cached Kube's `get` answers from its cache."""
        return self.get(kind, namespace, name)

    def known(self, kind: str, namespace: str, name: str) -> Obj | None:
        """`get`, but a cached Kube trusts its cache's miss too (it does not ask)."""
        return self.get(kind, namespace, name)

    def create(self, obj: Obj) -> Obj | None:
        """Create; None if it already exists (409 means someone, maybe we, made it) or
        its namespace is being deleted (and the owner with it)."""
        REQUESTS.labels("create", obj["kind"]).inc()
        path = KINDS[obj["kind"]].path(obj["metadata"]["namespace"])
        try:
            return self._call("POST", path, body=obj)
        except ApiException as error:
            if error.status == 409 or _namespace_terminating(error):
                return None
            raise

    def replace(self, obj: Obj) -> Obj | None:
        """PUT the whole object; None if it changed since it was read (409: its
        resourceVersion is not the latest), so the caller reads it again."""
        REQUESTS.labels("update", obj["kind"]).inc()
        meta = obj["metadata"]
        try:
            return self._call("PUT", KINDS[obj["kind"]].path(meta["namespace"], meta["name"]), obj)
        except ApiException as error:
            if error.status == 409:
                return None
            raise

    def patch(self, kind: str, namespace: str, name: str, patch: Any,
              content_type: str = MERGE_PATCH, subresource: str | None = None) -> Obj:  # fmt: skip
        REQUESTS.labels("patch", kind).inc()
        return self._call(
            "PATCH", KINDS[kind].path(namespace, name, subresource), patch, content_type
        )

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> Obj | None:
        """Delete that object (by uid: never a newer one of the same name); its
        dependents follow in the background. Gone already is fine. Returns the object
        while its finalizers hold it (with its deletionTimestamp); None once it is gone."""
        REQUESTS.labels("delete", kind).inc()
        options = {"preconditions": {"uid": uid}, "propagationPolicy": "Background"}
        try:
            left = self._call("DELETE", KINDS[kind].path(namespace, name), body=options)
        except ApiException as error:
            if error.status not in (404, 409):  # 409: the uid differs, a newer one is there
                raise
            return None
        # The answer is a Status, or the object as deleted: still there only if going.
        return left if "deletionTimestamp" in left.get("metadata", {}) else None

    def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        return self.listing(kind, namespace, label_selector)[0]

    def listing(
        self, kind: str, namespace: str, label_selector: str, verb: str = "list"
    ) -> tuple[Objs, int]:
        """From the API server: the objects, and the resourceVersion the list was taken
        at (etcd's revision; every object in it is at or below it). `verb`: what
        REQUESTS counts it as (a re-list of the cache is "relist", not a reconcile's read)."""
        REQUESTS.labels(verb, kind).inc()
        found = self._call(
            "GET", KINDS[kind].path(namespace), query=[("labelSelector", label_selector)]
        )
        items: Objs = found.get("items", [])
        return items, int(found["metadata"]["resourceVersion"])


def _namespace_terminating(error: ApiException) -> bool:
    return error.status == 403 and "NamespaceTerminating" in str(error.body or "")
