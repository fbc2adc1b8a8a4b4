"""Smoke tests proving the control plane is real: the scheduler enforces
selectors, taints and GPU capacity; the garbage collector follows owner
references; KubeRay reconciles RayClusters; helm installs charts; tokens and
RBAC work; our CRD's CEL rules are enforced by the API server."""

from __future__ import annotations

import base64
import json

import pytest
import yaml
from kubernetes import client

from .harness import GPU_RESOURCE, GPU_TOLERATION, REPO_ROOT
from .util import eventually, get_json


def pod(
    name: str, *, node_selector: dict | None = None, gpus: int = 0, tolerate_gpu: bool = False
) -> dict:
    container = {"name": "main", "image": "registry.invalid/sleep:1"}
    if gpus:
        container["resources"] = {"limits": {GPU_RESOURCE: str(gpus)}}
    spec = {"containers": [container]}
    if node_selector:
        spec["nodeSelector"] = node_selector
    if tolerate_gpu:
        spec["tolerations"] = [GPU_TOLERATION]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def apply(cp, namespace: str, *objects: dict, check: bool = True):
    manifest = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    return cp.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=check
    )


def scheduling_events(cp, namespace: str, pod_name: str) -> list[str]:
    events = get_json(
        cp,
        "events",
        "-n",
        namespace,
        f"--field-selector=involvedObject.name={pod_name},reason=FailedScheduling",
    )
    return [e["message"] for e in events["items"]]


def nodes_of_pool(cp, pool: str) -> set[str]:
    return {n["metadata"]["name"] for n in get_json(cp, "nodes", "-l", f"pool={pool}")["items"]}


# --------------------------------------------------------------------------- nodes


def test_fake_gpu_node_groups(controlplane):
    # kwok's nodes: the real node (node.py), where it runs, is in no pool.
    nodes = client.CoreV1Api(controlplane.api_client()).list_node(label_selector="type=kwok").items
    by_pool: dict[str, list] = {}
    for node in nodes:
        by_pool.setdefault(node.metadata.labels.get("pool"), []).append(node)
    assert sorted(by_pool) == ["a", "b", "cpu"]
    for pool in ("a", "b"):
        assert len(by_pool[pool]) == 2
        for node in by_pool[pool]:
            assert node.status.allocatable[GPU_RESOURCE] == "8"
            assert any(t.key == GPU_RESOURCE and t.effect == "NoSchedule" for t in node.spec.taints)
    (cpu_node,) = by_pool["cpu"]
    assert GPU_RESOURCE not in cpu_node.status.allocatable
    assert not cpu_node.spec.taints


# --------------------------------------------------------------------------- scheduler


def test_node_selector_and_toleration_place_pods_on_the_pool(controlplane, namespace):
    cp = controlplane
    names = [f"b-{i}" for i in range(4)]
    apply(
        cp,
        namespace,
        *[pod(n, node_selector={"pool": "b"}, gpus=4, tolerate_gpu=True) for n in names],
    )

    def placed():
        pods = get_json(cp, "pods", "-n", namespace)["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return (
            {p["metadata"]["name"]: p["spec"]["nodeName"] for p in running}
            if len(running) == 4
            else None
        )

    placement = eventually(placed, "4 pods Running")
    assert set(placement.values()) <= nodes_of_pool(cp, "b")
    # 4 pods x 4 GPUs on 2 nodes x 8 GPUs: the scheduler had to use both nodes.
    assert len(set(placement.values())) == 2


def test_gpu_taint_keeps_pods_without_toleration_off_gpu_nodes(controlplane, namespace):
    apply(controlplane, namespace, pod("no-toleration", node_selector={"pool": "a"}))
    messages = eventually(
        lambda: scheduling_events(controlplane, namespace, "no-toleration"),
        "a FailedScheduling event",
    )
    # The only nodes with pool=a are the GPU nodes, and they carry the GPU taint.
    assert any("untolerated taint" in m for m in messages), messages
    assert (
        get_json(controlplane, "pod", "no-toleration", "-n", namespace)["status"]["phase"]
        == "Pending"
    )


def test_pod_asking_for_more_gpus_than_any_node_has_stays_pending(controlplane, namespace):
    apply(controlplane, namespace, pod("too-big", gpus=9, tolerate_gpu=True))
    messages = eventually(
        lambda: scheduling_events(controlplane, namespace, "too-big"), "a FailedScheduling event"
    )
    assert any(f"Insufficient {GPU_RESOURCE}" in m for m in messages), messages
    status = get_json(controlplane, "pod", "too-big", "-n", namespace)["status"]
    assert status["phase"] == "Pending"
    assert any(
        c["type"] == "PodScheduled" and c["reason"] == "Unschedulable" for c in status["conditions"]
    )


# --------------------------------------------------------------------------- garbage collector


def test_deleting_owner_garbage_collects_child(controlplane, namespace):
    cp = controlplane
    cp.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = get_json(cp, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
            ],
        },
    }
    apply(cp, namespace, child)
    cp.kubectl("delete", "configmap", "owner", "-n", namespace)

    def child_gone():
        return cp.kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode != 0

    eventually(child_gone, "the garbage collector to delete the child ConfigMap")


# --------------------------------------------------------------------------- tokens and RBAC


def token_client(cp, token: str) -> client.ApiClient:
    """An API client that authenticates with a bearer token only (no admin cert)."""
    config = client.Configuration()
    config.host = cp.server
    config.ssl_ca_cert = str(cp.ca_file)
    config.api_key = {"authorization": token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(config)


def test_service_account_tokens_are_issued_and_rbac_is_enforced(controlplane, namespace):
    cp = controlplane
    cp.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    token = cp.kubectl("create", "token", "reader", "-n", namespace).stdout.strip()
    api = client.CoreV1Api(token_client(cp, token))

    review = client.AuthenticationV1Api(token_client(cp, token)).create_self_subject_review(
        client.V1SelfSubjectReview()
    )
    assert review.status.user_info.username == f"system:serviceaccount:{namespace}:reader"
    with pytest.raises(client.ApiException) as denied:
        api.list_namespaced_pod(namespace)
    assert denied.value.status == 403

    cp.kubectl(
        "create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace
    )
    cp.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )

    def allowed():
        try:
            api.list_namespaced_pod(namespace)
            return True
        except client.ApiException:
            return False

    eventually(allowed, "the RoleBinding to take effect")
    # The controller manager publishes the cluster CA into every namespace.
    root_ca = get_json(cp, "configmap", "kube-root-ca.crt", "-n", namespace)
    assert "BEGIN CERTIFICATE" in root_ca["data"]["ca.crt"]


def test_controller_manager_signs_legacy_tokens_the_api_server_accepts(controlplane, namespace):
    """The token controller fills a service-account-token Secret, signing with the
    controller manager's key; the API server must verify it with its public key."""
    cp = controlplane
    cp.kubectl("create", "serviceaccount", "legacy", "-n", namespace)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/service-account-token",
        "metadata": {
            "name": "legacy-token",
            "annotations": {"kubernetes.io/service-account.name": "legacy"},
        },
    }
    apply(cp, namespace, secret)

    def filled_token():
        data = get_json(cp, "secret", "legacy-token", "-n", namespace).get("data") or {}
        return base64.b64decode(data["token"]).decode() if "token" in data else None

    token = eventually(filled_token, "the token controller to fill the Secret")
    review = client.AuthenticationV1Api(token_client(cp, token)).create_self_subject_review(
        client.V1SelfSubjectReview()
    )
    assert review.status.user_info.username == f"system:serviceaccount:{namespace}:legacy"


# --------------------------------------------------------------------------- KubeRay


RAYCLUSTER = """
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: smoke
spec:
  rayVersion: "2.49.0"
  headGroupSpec:
    rayStartParams: {}
    template:
      spec:
        containers:
          - name: ray-head
            image: rayproject/ray:2.49.0
            resources:
              limits: {cpu: "2", memory: 4Gi}
  workerGroupSpecs:
    - groupName: pool-a
      replicas: 2
      minReplicas: 2
      maxReplicas: 2
      rayStartParams: {}
      template:
        spec:
          nodeSelector: {pool: a}
          tolerations:
            - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
          containers:
            - name: ray-worker
              image: rayproject/ray:2.49.0
              resources:
                limits: {cpu: "4", memory: 16Gi, nvidia.com/gpu: "8"}
"""


def test_raycluster_is_reconciled_into_pods_on_the_right_node_groups(
    controlplane, namespace, tmp_path
):
    cp = controlplane
    manifest = tmp_path / "raycluster.yaml"
    manifest.write_text(RAYCLUSTER)
    cp.kubectl("apply", "-n", namespace, "-f", str(manifest))

    def running_pods():
        pods = get_json(cp, "pods", "-n", namespace, "-l", "ray.io/cluster=smoke")["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return running if len(running) == 3 else None

    pods = eventually(running_pods, "the head and 2 worker pods Running")
    by_type = {}
    for p in pods:
        by_type.setdefault(p["metadata"]["labels"]["ray.io/node-type"], []).append(
            p["spec"]["nodeName"]
        )
    assert set(by_type["head"]) <= nodes_of_pool(cp, "cpu")
    # 8 GPUs each: one worker per pool-a node.
    assert sorted(by_type["worker"]) == sorted(nodes_of_pool(cp, "a"))

    state = eventually(
        lambda: (
            get_json(cp, "raycluster", "smoke", "-n", namespace).get("status", {}).get("state")
            == "ready"
        ),
        "RayCluster status.state=ready",
    )
    assert state


# --------------------------------------------------------------------------- helm


def test_helm_installs_a_chart(controlplane, namespace, tmp_path):
    cp = controlplane
    cp.helm("create", str(tmp_path / "demo"))
    # --wait: the chart's Deployment must become available, i.e. scheduled and run on a kwok node.
    cp.helm("install", "demo", str(tmp_path / "demo"), "-n", namespace, "--wait", "--timeout", "2m")
    releases = json.loads(cp.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]
    deployment = get_json(cp, "deployment", "demo", "-n", namespace)
    assert deployment["status"]["availableReplicas"] == 1


# --------------------------------------------------------------------------- our CRD

RLHFJOB_CRD = REPO_ROOT / "crds" / "rlhfjobs.yaml"
EXAMPLES = REPO_ROOT / "examples"


def cel_message(crd: dict, field_path: str, starting: str) -> str:
    """The message of the spec-level CEL rule that reports at `field_path` and starts
    with `starting`."""
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [
        r
        for r in spec_schema["x-kubernetes-validations"]
        if r.get("fieldPath") == field_path and r["message"].startswith(starting)
    ]
    return " ".join(rule["message"].split())


def test_rlhfjob_crd_accepts_valid_and_rejects_invalid_jobs_with_cel_message(
    controlplane, namespace, tmp_path
):
    cp = controlplane
    crd = yaml.safe_load(RLHFJOB_CRD.read_text())
    # The harness applied everything in crds/ before the first test.
    assert RLHFJOB_CRD.name not in cp.crd_errors, cp.crd_errors[RLHFJOB_CRD.name]
    assert get_json(cp, "crd", crd["metadata"]["name"])["spec"]["names"]["shortNames"] == ["rlhf"]

    job = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    valid = tmp_path / "valid.yaml"
    valid.write_text(yaml.safe_dump(job))
    cp.kubectl("apply", "-n", namespace, "-f", str(valid))
    assert (
        get_json(cp, "rlhf", job["metadata"]["name"], "-n", namespace)["spec"]["roles"]
        == job["spec"]["roles"]
    )

    job["metadata"]["name"] = "undeclared-pool"
    job["spec"]["roles"]["critic"] = "no-such-pool"
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text(yaml.safe_dump(job))
    rejected = cp.kubectl("apply", "-n", namespace, "-f", str(invalid), check=False)

    assert rejected.returncode != 0
    error = " ".join(rejected.stderr.split())
    assert "spec.roles.critic" in error
    assert cel_message(crd, ".roles.critic", "must name a pool") in error
    assert (
        cp.kubectl("get", "rlhf", "undeclared-pool", "-n", namespace, check=False).returncode != 0
    )


CRITIC_FREE_MISTAKES = [
    # (what the user wrote, over the local example; the field the API server must name)
    ({"algorithm": {"advantageEstimator": "ppo2"}}, "spec.algorithm.advantageEstimator"),
    ({"algorithm": {"advantageEstimator": "grpo"}}, "spec.generation.samplesPerPrompt"),
    (
        {"algorithm": {"advantageEstimator": "grpo"}, "generation": {"samplesPerPrompt": 4}},
        "spec.roles.critic",
    ),
    ({"algorithm": {"clipRatioLow": 0.3, "clipRatioHigh": 0.2}}, "spec.algorithm.clipRatioHigh"),
]


def test_critic_free_mistakes_are_rejected_at_admission_naming_the_field(
    controlplane, namespace, tmp_path
):
    for index, (change, field) in enumerate(CRITIC_FREE_MISTAKES):
        job = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
        job["metadata"]["name"] = f"mistake-{index}"
        for section, values in change.items():
            job["spec"].setdefault(section, {}).update(values)
        manifest = tmp_path / f"mistake-{index}.yaml"
        manifest.write_text(yaml.safe_dump(job))
        rejected = controlplane.kubectl("apply", "-n", namespace, "-f", str(manifest), check=False)
        assert rejected.returncode != 0, f"{change} was admitted"
        assert field in " ".join(rejected.stderr.split()), rejected.stderr
