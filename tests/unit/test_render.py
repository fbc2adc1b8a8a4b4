"""Rendering: every example becomes objects that KubeRay's schema accepts, placed and
secured as the spec says. Snapshots catch unintended changes (UPDATE_SNAPSHOTS=1 to accept)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.kuberay import pruned_fields
from rlhf_operator.render.children import JobRef, render_children, render_rayjob
from rlhf_operator.render.network import CLUSTER_RANGES, NetworkAccess, Peers
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.names import POOL_LABEL, pool_resource
from tests.unit.conftest import EXAMPLES, load

DATA = Path(__file__).parent / "data"
SNAPSHOTS = Path(__file__).parent / "snapshots"
RAYJOB_SCHEMA = json.loads((DATA / "kuberay-v1.7.0-rayjob-schema.json").read_text())["schema"]


def render(
    example: str, namespace: str = "team-a", network: NetworkAccess | None = None
) -> dict[str, dict[str, Any]]:
    job = parse_job(load(EXAMPLES[0].parent / example))
    ref = JobRef(job.metadata.name, namespace, uid=f"uid-{job.metadata.name}")
    return {o["kind"]: o for o in render_children(ref, job.spec, network)}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rayjob_matches_kuberay_schema(path: Path) -> None:
    rayjob = render(path.name)["RayJob"]
    jsonschema.Draft4Validator(RAYJOB_SCHEMA).validate(rayjob)
    assert pruned_fields(RAYJOB_SCHEMA, rayjob) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_snapshot(path: Path) -> None:
    job = parse_job(load(path))
    ref = JobRef(job.metadata.name, "default", uid="00000000-0000-0000-0000-000000000000")
    text = yaml.safe_dump_all(render_children(ref, job.spec), sort_keys=False)
    snapshot = SNAPSHOTS / path.name
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snapshot.write_text(text)
    assert snapshot.read_text() == text, (
        f"rendering of {path.name} changed; UPDATE_SNAPSHOTS=1 to accept"
    )


def test_children_are_named_after_the_job_labelled_and_owned_by_it() -> None:
    objects = render("fully-async.yaml")
    assert {o["metadata"]["name"] for o in objects.values()} == {
        "fully-async",
        "fully-async-spec",
        "fully-async-reporter",
    }
    for obj in objects.values():
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"]["rlhf.dev/job"] == "fully-async"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "rlhf-operator"
        [owner] = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "rlhf.dev/v1alpha1",
            "kind": "RLHFJob",
            "name": "fully-async",
            "uid": "uid-fully-async",
            "controller": True,
            "blockOwnerDeletion": True,
        }


def test_one_worker_group_per_pool_with_its_gpus_nodes_and_ray_resource() -> None:
    cluster = render("asymmetric-6-2.yaml")["RayJob"]["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"policy", "value"}
    for name, gpus in (("policy", "6"), ("value", "2")):
        group = groups[name]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
        assert group["resources"] == {"GPU": gpus, pool_resource(name): gpus}
        assert group["labels"] == {POOL_LABEL: name}
        pod = group["template"]["spec"]
        assert group["template"]["metadata"]["labels"][POOL_LABEL] == name
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert pod["nodeSelector"] == {"pool": "a"}
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        assert "affinity" not in pod  # separation: gpu lets the two pools share the node


def test_node_separation_adds_required_anti_affinity_against_other_pools() -> None:
    groups = render("two-nodes-by-node-8-8.yaml")["RayJob"]["spec"]["rayClusterSpec"][
        "workerGroupSpecs"
    ]
    for group in groups:
        [term] = group["template"]["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert {"key": POOL_LABEL, "operator": "NotIn", "values": [group["groupName"]]} in term[
            "labelSelector"
        ]["matchExpressions"]
        assert {"key": "rlhf.dev/job", "operator": "In", "values": ["two-nodes-8-8"]} in term[
            "labelSelector"
        ]["matchExpressions"]


def test_user_affinity_is_kept_and_merged_with_separation() -> None:
    manifest = load(EXAMPLES[0].parent / "two-nodes-by-node-8-8.yaml")
    node_affinity = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu-type", "operator": "In", "values": ["h100"]}]}
            ]
        }
    }
    manifest["spec"]["pools"][0]["affinity"] = {"nodeAffinity": node_affinity}
    job = parse_job(manifest)
    rayjob = render_children(JobRef("j", "ns", "u"), job.spec)[-1]
    affinity = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
        "affinity"
    ]
    assert affinity["nodeAffinity"] == node_affinity
    assert len(affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1
    assert job.spec.pools[0].affinity == {"nodeAffinity": node_affinity}  # the spec is not mutated


def kuberay_head_service_ports(container: dict) -> dict[str, int]:
    """The head Service's ports as KubeRay derives them (getServicePorts in its
    common/service.go): its defaults only when the container declares no port at all,
    and "metrics" added when missing."""
    declared = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    defaults = {"client": 10001, "gcs-server": 6379, "dashboard": 8265, "serve": 8000}
    return {"metrics": 8080, **(declared or defaults)}


def test_head_runs_the_driver_on_cpu_with_the_mounted_spec() -> None:
    objects = render("local-cpu.yaml")
    rayjob = objects["RayJob"]["spec"]
    assert rayjob["entrypoint"] == (
        "python -m rlhf_trainer --spec /etc/rlhf/spec.json --metrics-port 9400"
    )
    head = rayjob["rayClusterSpec"]["headGroupSpec"]
    annotations = head["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400"}
    assert head["rayStartParams"] == {"num-cpus": "0"}
    container = head["template"]["spec"]["containers"][0]
    assert not any("gpu" in k for k in container["resources"]["limits"])
    assert kuberay_head_service_ports(container) == {
        "gcs-server": 6379,
        "dashboard": 8265,  # where KubeRay submits the job: without it, no submitter
        "client": 10001,
        "metrics": 8080,  # Ray's own, where KubeRay's stock monitors look
        "trainer-metrics": 9400,
    }
    assert {"name": "spec", "mountPath": "/etc/rlhf", "readOnly": True} in container["volumeMounts"]
    handed_over = JobConfig.model_validate_json(objects["ConfigMap"]["data"]["spec.json"])
    assert handed_over == parse_job(load(EXAMPLES[0].parent / "local-cpu.yaml")).spec.job_config()


def test_suspend_is_passed_to_the_rayjob() -> None:
    manifest = load(EXAMPLES[0].parent / "local-cpu.yaml")
    manifest["spec"]["suspend"] = True
    rayjob = render_children(JobRef("j", "ns", "u"), parse_job(manifest).spec)[-1]
    assert rayjob["spec"]["suspend"] is True


def test_pods_run_as_non_root_and_only_the_head_gets_an_api_token() -> None:
    rayjob = render("split-8gpu-4-4.yaml")["RayJob"]["spec"]
    cluster = rayjob["rayClusterSpec"]
    templates = [
        cluster["headGroupSpec"]["template"],
        rayjob["submitterPodTemplate"],
        *(g["template"] for g in cluster["workerGroupSpecs"]),
    ]
    for template in templates:
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            }
    assert cluster["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert all(
        g["template"]["spec"]["automountServiceAccountToken"] is False
        for g in cluster["workerGroupSpecs"]
    )


def test_reporter_may_patch_only_this_jobs_status() -> None:
    objects = render("colocated.yaml")
    assert objects["Role"]["rules"] == [
        {
            "apiGroups": ["rlhf.dev"],
            "resources": ["rlhfjobs/status"],
            "resourceNames": ["colocated"],
            "verbs": ["get", "patch"],
        }
    ]
    assert objects["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "colocated-reporter", "namespace": "team-a"}
    ]
    assert objects["RoleBinding"]["roleRef"]["name"] == "colocated-reporter"
    head = objects["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head["serviceAccountName"] == "colocated-reporter"


def test_the_ray_version_given_to_kuberay_is_the_one_the_image_installs() -> None:
    from rlhf_operator.render.children import RAY_VERSION

    lock = (Path(__file__).parents[2] / "trainer_image" / "requirements-cpu.txt").read_text()
    assert f"ray=={RAY_VERSION}" in lock.splitlines()


def pod_specs(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The head's and every worker group's pod spec, as rendered for `manifest`."""
    job = parse_job(manifest)
    cluster = render_rayjob(JobRef(job.metadata.name, "ns", "uid"), job.spec)["spec"][
        "rayClusterSpec"
    ]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]
    ]


def test_a_checkpoint_claim_is_mounted_at_the_checkpoint_path_on_every_pod() -> None:
    manifest = load(EXAMPLES[0].parent / "two-nodes-by-node-8-8.yaml")
    manifest["spec"]["checkpointClaim"] = "rlhf-checkpoints"
    manifest["spec"]["trainer"]["checkpoint"] = {"path": "/mnt/ckpt"}
    pods = pod_specs(manifest)
    assert len(pods) == 3
    for pod in pods:
        claim = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "rlhf-checkpoints"}}
        assert claim in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "checkpoints", "mountPath": "/mnt/ckpt"} in mounts
    without = render("two-nodes-by-node-8-8.yaml")["RayJob"]["spec"]["rayClusterSpec"]
    assert "checkpoints" not in str(without)


def test_an_output_claim_is_mounted_at_output_on_every_pod_as_the_actor_writes_there() -> None:
    manifest = load(EXAMPLES[0].parent / "two-nodes-by-node-8-8.yaml")
    manifest["spec"]["output"] = {"path": "/output/policy", "claim": "served-models"}
    pods = pod_specs(manifest)
    assert len(pods) == 3
    for pod in pods:
        claim = {"name": "output", "persistentVolumeClaim": {"claimName": "served-models"}}
        assert claim in pod["volumes"]
        assert {"name": "output", "mountPath": "/output"} in pod["containers"][0]["volumeMounts"]
    on_checkpoints = load(EXAMPLES[0].parent / "two-nodes-by-node-8-8.yaml")
    on_checkpoints["spec"] |= {"checkpointClaim": "c", "output": {"path": "/checkpoints/model"}}
    assert all(v["name"] != "output" for p in pod_specs(on_checkpoints) for v in p["volumes"])


def test_a_reward_files_configmap_is_mounted_read_only_on_every_ray_pod() -> None:
    manifest = load(EXAMPLES[0].parent / "cpu-cluster.yaml")
    manifest["spec"]["models"]["reward"] = {"function": "file:score.py:score", "configMap": "rw"}
    pods = pod_specs(manifest)
    assert len(pods) >= 2  # the head, which runs the driver, and the workers
    for pod in pods:
        files = {"name": "reward-files", "configMap": {"name": "rw", "defaultMode": 0o444}}
        assert files in pod["volumes"]
        mount = {"name": "reward-files", "mountPath": "/etc/rlhf-reward", "readOnly": True}
        assert mount in pod["containers"][0]["volumeMounts"]
    without = pod_specs(load(EXAMPLES[0].parent / "cpu-cluster.yaml"))
    assert "reward-files" not in str(without)


def test_a_critic_free_job_renders_no_critic_and_one_worker_group_per_pool() -> None:
    objects = render("grpo-split.yaml")
    cluster = objects["RayJob"]["spec"]["rayClusterSpec"]
    assert {g["groupName"] for g in cluster["workerGroupSpecs"]} == {"train", "generate"}
    handed_over = JobConfig.model_validate_json(objects["ConfigMap"]["data"]["spec.json"])
    assert handed_over.roles.critic is None and handed_over.models.critic is None
    assert handed_over.algorithm.advantage_estimator == "grpo"
    assert handed_over.samples_per_step == 64 * 8


PROMETHEUS = {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}
KUBERAY = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}


def test_with_network_access_a_job_admits_its_own_pods_prometheus_and_kuberay_only() -> None:
    children = render("fully-async.yaml", network=NetworkAccess(Peers(PROMETHEUS, KUBERAY)))
    assert list(children)[-1] == "RayJob"  # still created last, after its dependencies
    policy = children["NetworkPolicy"]
    job_pods = {  # by component: an environment's pods carry the job label too
        "matchLabels": {"rlhf.dev/job": "fully-async"},
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In",
             "values": ["head", "worker", "submitter"]}
        ],
    }  # fmt: skip
    assert policy["metadata"]["ownerReferences"][0]["name"] == "fully-async"
    assert policy["spec"]["podSelector"] == job_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    admitted = {
        json.dumps(rule["from"]): sorted(p["port"] for p in rule.get("ports", []))
        for rule in policy["spec"]["ingress"]
    }
    assert admitted == {
        json.dumps([{"podSelector": job_pods}]): [],  # every port: Ray and NCCL use many
        json.dumps([PROMETHEUS]): [8080, 9400],  # Ray's and the trainer's metrics
        json.dumps([KUBERAY]): [8265],  # the Ray dashboard, where KubeRay follows the job
    }
    assert "NetworkPolicy" not in render("fully-async.yaml")


OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rlhf"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rlhf-operator"}}}  # fmt: skip


def test_the_operator_named_by_the_chart_may_ask_the_head_how_the_job_ended() -> None:
    """Beside KubeRay, on the dashboard port only (its job API, restarts.head_job_url)."""
    access = NetworkAccess(Peers(PROMETHEUS, KUBERAY, OPERATOR))
    policy = render("fully-async.yaml", network=access)["NetworkPolicy"]
    (dashboard,) = [r for r in policy["spec"]["ingress"] if r["from"][0] == KUBERAY]
    assert dashboard == {"from": [KUBERAY, OPERATOR], "ports": [{"protocol": "TCP", "port": 8265}]}


def test_network_access_comes_from_the_environment_the_chart_sets() -> None:
    assert NetworkAccess.from_env({}) == NetworkAccess()  # no peers, the default ranges
    raw = json.dumps({"prometheus": PROMETHEUS, "kuberay": KUBERAY})
    assert NetworkAccess.from_env({"RLHF_NETWORK_POLICY": raw}) == NetworkAccess(
        Peers(PROMETHEUS, KUBERAY)
    )
    raw = json.dumps({"prometheus": PROMETHEUS, "kuberay": KUBERAY, "operator": OPERATOR})
    assert NetworkAccess.from_env({"RLHF_NETWORK_POLICY": raw}) == NetworkAccess(
        Peers(PROMETHEUS, KUBERAY, OPERATOR)
    )
    with pytest.raises(ValueError, match="RLHF_NETWORK_POLICY must be a JSON object with"):
        NetworkAccess.from_env({"RLHF_NETWORK_POLICY": '{"prometheus": {}}'})
    cluster = json.dumps({"clusterRanges": ["10.96.0.0/12"], "dns": [KUBERAY]})
    assert NetworkAccess.from_env({"RLHF_CLUSTER_NETWORK": cluster}) == NetworkAccess(
        None, ("10.96.0.0/12",), (KUBERAY,)
    )
    assert NetworkAccess().cluster_ranges == CLUSTER_RANGES
    bad = json.dumps({"clusterRanges": ["10.96.0.1/12"], "dns": []})
    with pytest.raises(ValueError, match=r"RLHF_CLUSTER_NETWORK must be .* 'clusterRanges'"):
        NetworkAccess.from_env({"RLHF_CLUSTER_NETWORK": bad})


POD_SETTINGS = {
    "volumes": [
        {"name": "models", "mountPath": "/models", "readOnly": True,
         "persistentVolumeClaim": {"claimName": "models"}},
        {"name": "cache", "mountPath": "/cache", "emptyDir": {"sizeLimit": "100Gi"}},
    ],
    "env": [
        {"name": "HF_HOME", "value": "/cache/huggingface"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
    ],
    "envFrom": [{"secretRef": {"name": "s3-credentials"}}],
    "imagePullSecrets": [{"name": "registry"}],
    "priorityClassName": "rlhf-high",
    "labels": {"team": "ml"},
    "annotations": {"owner": "ml-platform"},
}  # fmt: skip


def pod_templates(rayjob: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return {
        "head": cluster["headGroupSpec"]["template"],
        "submitter": rayjob["spec"]["submitterPodTemplate"],
        **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]},
    }


def test_pod_settings_reach_every_ray_pod_and_the_submitter_only_what_it_needs() -> None:
    manifest = load(EXAMPLES[0].parent / "split-8gpu-4-4.yaml")
    manifest["spec"]["pods"] = POD_SETTINGS
    job = parse_job(manifest)
    objects = render_children(JobRef(job.metadata.name, "ns", "uid"), job.spec)
    templates = pod_templates(objects[-1])
    for name, template in templates.items():
        pod, container = template["spec"], template["spec"]["containers"][0]
        assert pod["imagePullSecrets"] == [{"name": "registry"}], name
        assert pod["priorityClassName"] == "rlhf-high", name
        assert template["metadata"]["labels"]["team"] == "ml", name
        assert template["metadata"]["labels"]["rlhf.dev/job"] == "split-8gpu", name
        assert template["metadata"]["annotations"]["owner"] == "ml-platform", name
        if name == "submitter":  # it only runs `ray job submit`: no secrets, no data
            assert "envFrom" not in container and "volumeMounts" not in container
            continue
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container[
            "volumeMounts"
        ]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in pod[
            "volumes"
        ]
        assert {"name": "cache", "emptyDir": {"sizeLimit": "100Gi"}} in pod["volumes"]
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": "hf-token", "key": "token"}
        }
        assert {"RLHF_JOB_NAME", "RLHF_JOB_NAMESPACE", "HF_HOME"} <= set(env)
        assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    # The head keeps the operator's own annotations beside the job's.
    assert templates["head"]["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    # What the trainer reads is the training spec only: no secret's name, no env.
    configmap = json.dumps(objects[0])
    assert "hf-token" not in configmap and "s3-credentials" not in configmap
    assert "HF_HOME" not in configmap


def test_pool_extra_resources_and_shm_size() -> None:
    manifest = load(EXAMPLES[0].parent / "split-8gpu-4-4.yaml")
    manifest["spec"]["pools"][0] |= {"extraResources": {"rdma/hca": 1}, "shmSize": "32Gi"}
    manifest["spec"]["head"] = {"shmSize": "2Gi"}
    job = parse_job(manifest)
    templates = pod_templates(render_rayjob(JobRef(job.metadata.name, "ns", "uid"), job.spec))
    resources = templates["actor-rollout-ref"]["spec"]["containers"][0]["resources"]
    for side in ("requests", "limits"):
        assert resources[side] == {
            "cpu": "14",
            "memory": "100Gi",
            "rdma/hca": "1",
            "nvidia.com/gpu": "4",
        }
    assert "rdma/hca" not in str(templates["critic"]["spec"]["containers"][0]["resources"])

    def shm(template: dict[str, Any]) -> dict[str, Any]:
        return next(v for v in template["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"]

    assert shm(templates["actor-rollout-ref"]) == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert shm(templates["head"]) == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert shm(templates["critic"]) == {"medium": "Memory"}


def test_a_gang_scheduler_is_named_to_kuberay_on_the_rayjob_only() -> None:
    manifest = load(EXAMPLES[0].parent / "split-8gpu-4-4.yaml")
    manifest["spec"]["schedulerName"] = "volcano"
    job = parse_job(manifest)
    objects = {o["kind"]: o for o in render_children(JobRef("j", "ns", "uid"), job.spec)}
    assert objects["RayJob"]["metadata"]["labels"]["ray.io/scheduler-name"] == "volcano"
    others = [o for kind, o in objects.items() if kind != "RayJob"]
    assert all("ray.io/scheduler-name" not in o["metadata"]["labels"] for o in others)
    assert (
        "ray.io/scheduler-name" not in render("split-8gpu-4-4.yaml")["RayJob"]["metadata"]["labels"]
    )


def test_a_queued_job_hands_kueue_its_rayjob_suspended_with_the_queue_label() -> None:
    manifest = load(EXAMPLES[0].parent / "split-8gpu-4-4.yaml")
    manifest["spec"]["queueName"] = "team-a"
    objects = {
        o["kind"]: o for o in render_children(JobRef("j", "ns", "uid"), parse_job(manifest).spec)
    }
    rayjob = objects["RayJob"]
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert rayjob["spec"]["suspend"] is True  # Kueue resumes it when it admits it
    others = [o for kind, o in objects.items() if kind != "RayJob"]
    assert all("kueue.x-k8s.io/queue-name" not in o["metadata"]["labels"] for o in others)
    unqueued = render("split-8gpu-4-4.yaml")["RayJob"]
    assert "kueue.x-k8s.io/queue-name" not in unqueued["metadata"]["labels"]
    assert unqueued["spec"]["suspend"] is False


def ray_pod_templates(rayjob: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return {
        "head": cluster["headGroupSpec"]["template"],
        "submitter": rayjob["spec"]["submitterPodTemplate"],
        **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]},
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_ray_pod_requests_cpu_and_memory(path: Path) -> None:
    """Without them a pod is Burstable with no memory request (the first evicted), and
    KubeRay gives Ray no --num-cpus/--memory, so Ray counts the whole node's."""
    for name, template in ray_pod_templates(render(path.name)["RayJob"]).items():
        resources = template["spec"]["containers"][0]["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), name
        assert resources["requests"] == resources["limits"], name  # Guaranteed QoS


def test_pool_resources_default_per_gpu_and_per_field() -> None:
    manifest = load(EXAMPLES[0].parent / "colocated.yaml")
    pool = manifest["spec"]["pools"][0]
    pool.pop("resources", None)
    pool["gpusPerNode"] = 2
    worker = render_children(JobRef("j", "ns", "u"), parse_job(manifest).spec)[-1]
    requests = ray_pod_templates(worker)[pool["name"]]["spec"]["containers"][0]["resources"]
    assert requests["limits"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}
    pool["resources"] = {"cpu": 3}  # memory still defaults
    worker = render_children(JobRef("j", "ns", "u"), parse_job(manifest).spec)[-1]
    requests = ray_pod_templates(worker)[pool["name"]]["spec"]["containers"][0]["resources"]
    assert requests["limits"] == {"cpu": "3", "memory": "64Gi", "nvidia.com/gpu": "2"}


def test_a_cpu_pool_asks_for_no_gpu_and_ray_sees_a_logical_gpu_per_slot() -> None:
    manifest = load(EXAMPLES[0].parent / "colocated.yaml")
    pool = manifest["spec"]["pools"][0]
    pool.pop("resources", None)
    pool.update(device="cpu", gpusPerNode=4)
    rayjob = render_children(JobRef("j", "ns", "u"), parse_job(manifest).spec)[-1]
    group = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "4", "memory": "16Gi"}
    assert group["resources"] == {"GPU": "4", f"rlhf-pool-{pool['name']}": "4"}
