"""The environments the operator runs for a job: a Deployment, a Service and a
NetworkPolicy each, secured and reachable as the spec says; and the reconciler's drift
check, which must not patch what the API server filled in."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_operator.controller.drift import OWNED_FIELDS, drifted
from rlhf_operator.render.children import JobRef, render_children
from rlhf_operator.render.network import NetworkAccess, Peers
from rlhf_operator.render.pod import container_security, pod_security
from tests.rendered import matches, of_kind, pod_labels
from tests.unit.conftest import EXAMPLES, load

Obj = dict[str, Any]
JOB = JobRef("agentic", "team-a", uid="uid-agentic")
LOOKUP = {"name": "lookup", "serve": "rlhf_env.toys:LetterLookup"}
NETWORK = NetworkAccess(
    Peers(
        prometheus={"namespaceSelector": {"matchLabels": {"team": "monitoring"}}},
        kuberay={"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}},
    )
)


def children(*environments: Obj, network: NetworkAccess | None = None) -> list[Obj]:
    """The children of the agentic example with these environments (the first is the
    one its episodes run in)."""
    manifest = load(EXAMPLES[0].parent / "agentic-cluster.yaml")
    manifest["spec"]["environments"] = list(environments)
    manifest["spec"]["generation"]["multiTurn"]["environment"] = environments[0]["name"]
    manifest["spec"]["pods"] = {"env": [{"name": "HF_TOKEN", "value": "secret"}]}
    return render_children(JOB, parse_job(manifest).spec, network)


def test_a_served_environment_runs_the_class_on_the_jobs_image_secured() -> None:
    objects = children(LOOKUP)
    kinds = [o["kind"] for o in objects]
    assert kinds[-1] == "RayJob"  # still last: its pods need the rest
    assert kinds.index("Deployment") < kinds.index("Service") < kinds.index("RayJob")
    [deployment] = of_kind(objects, "Deployment")
    meta = deployment["metadata"]
    assert meta["name"] == "agentic-env-lookup" and meta["namespace"] == "team-a"
    assert meta["ownerReferences"][0]["uid"] == "uid-agentic"
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "rlhf-trainer:0.1.0-cpu"  # the job's spec.image
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert container["command"] == [
        "python", "-m", "rlhf_env", "serve", "rlhf_env.toys:LetterLookup",
        "--host", "0.0.0.0", "--port", "8000",
        "--call-seconds", "30", "--idle-seconds", "1800",  # the episodes' own limits
    ]  # fmt: skip
    assert container["ports"] == [{"name": "env", "containerPort": 8000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "env"}
    # Live while its loop answers and its threads run: not merely its port open.
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "env"}
    assert container["resources"]["limits"] == {  # the defaults
        "cpu": "500m", "memory": "1Gi", "ephemeral-storage": "512Mi"
    }  # fmt: skip
    # Restricted Pod Security, as the Ray pods, and a read-only root with a scratch /tmp.
    assert pod["securityContext"] == pod_security()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {**container_security(), "readOnlyRootFilesystem": True}
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert pod["enableServiceLinks"] is False
    assert "env" not in container and "envFrom" not in container  # not the job's pods.env


def test_the_service_selects_exactly_its_environments_pods_and_the_trainer_gets_its_url() -> None:
    objects = children(LOOKUP, {"name": "calc", "serve": "rlhf_env.toys:LetterLookup"})
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    deployments = {d["metadata"]["name"]: d for d in of_kind(objects, "Deployment")}
    assert set(services) == set(deployments) == {"agentic-env-lookup", "agentic-env-calc"}
    for name, service in services.items():
        assert service["spec"]["clusterIP"] == "None"  # headless: one address per replica
        assert service["spec"]["ports"] == [
            {"name": "env", "port": 8000, "targetPort": "env", "protocol": "TCP"}
        ]
        for other, deployment in deployments.items():
            template = deployment["spec"]["template"]["metadata"]["labels"]
            assert matches({"matchLabels": service["spec"]["selector"]}, template) == (
                other == name
            )
            assert matches(deployment["spec"]["selector"], template)
    config = json.loads(of_kind(objects, "ConfigMap")[0]["data"]["spec.json"])
    assert config["environments"] == [
        {"name": "lookup", "url": "http://agentic-env-lookup:8000"},
        {"name": "calc", "url": "http://agentic-env-calc:8000"},
    ]


def test_an_image_and_command_replace_the_defaults() -> None:
    sandbox = {
        "name": "sandbox",
        "image": "registry.example/sandbox:2",
        "command": ["sandbox-server", "--listen", ":9000"],
        "port": 9000,
        "replicas": 3,
        "resources": {"cpu": 2, "memory": "4Gi"},
        "env": [{"name": "MODE", "valueFrom": {"secretKeyRef": {"name": "s", "key": "mode"}}}],
    }
    objects = children(sandbox)
    [deployment] = of_kind(objects, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "registry.example/sandbox:2"
    assert container["command"] == ["sandbox-server", "--listen", ":9000"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "env"}
    assert container["ports"][0]["containerPort"] == 9000
    assert container["resources"]["requests"] == {
        "cpu": "2", "memory": "4Gi", "ephemeral-storage": "512Mi"
    }  # fmt: skip
    assert container["env"] == sandbox["env"]
    [service] = of_kind(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == 9000
    assert service["spec"]["clusterIP"] == "None"  # headless: the trainer picks each replica
    [policy] = of_kind(objects, "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9000}]
    config = json.loads(of_kind(objects, "ConfigMap")[0]["data"]["spec.json"])
    assert config["environments"] == [{"name": "sandbox", "url": "http://agentic-env-sandbox:9000"}]


def test_the_servers_limits_are_the_specs_else_the_episodes() -> None:
    limited = {**LOOKUP, "maxSessions": 4, "callTimeoutSeconds": 12.5, "sessionIdleSeconds": 90}
    objects = children(limited, {"name": "calc", "serve": "rlhf_env.toys:Calculator"})
    commands = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["command"][9:]
        for d in of_kind(objects, "Deployment")
    }
    assert commands == {
        "agentic-env-lookup": [
            "--max-sessions", "4", "--call-seconds", "12.5", "--idle-seconds", "90",
        ],
        "agentic-env-calc": ["--call-seconds", "30", "--idle-seconds", "1800"],
    }  # fmt: skip


@pytest.mark.parametrize("egress", [None, False])
def test_an_environment_has_no_egress_unless_asked(egress: bool | None) -> None:
    """Nor does the job then need a policy of its own: the environment reaches nothing.
    (tests/unit/test_environment_egress.py: what egress gives.)"""
    environment = LOOKUP | ({} if egress is None else {"egress": egress})
    [policy] = of_kind(children(environment), "NetworkPolicy")
    assert policy["metadata"]["name"] == "agentic-env-lookup"
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["egress"] == []


def test_an_environment_at_a_url_renders_nothing() -> None:
    objects = children({"name": "lookup", "url": "http://lookup.tools.svc:8000"})
    assert not of_kind(objects, "Deployment") and not of_kind(objects, "Service")
    assert not of_kind(objects, "NetworkPolicy")
    config = json.loads(of_kind(objects, "ConfigMap")[0]["data"]["spec.json"])
    assert config["environments"] == [{"name": "lookup", "url": "http://lookup.tools.svc:8000"}]


def test_only_the_jobs_ray_pods_reach_an_environment_and_it_reaches_no_ray_pod() -> None:
    objects = children(LOOKUP, network=NETWORK)
    policies = {p["metadata"]["name"]: p for p in of_kind(objects, "NetworkPolicy")}
    job_policy, env_policy = policies["agentic"], policies["agentic-env-lookup"]
    [deployment] = of_kind(objects, "Deployment")
    env_pod = deployment["spec"]["template"]["metadata"]["labels"]
    ray_pods = pod_labels(objects)
    del ray_pods[deployment["metadata"]["name"]]  # the environment's own
    [ingress] = env_policy["spec"]["ingress"]
    [source] = ingress["from"]
    assert list(source) == ["podSelector"]  # this namespace only
    for role, labels in ray_pods.items():
        # The driver (head) and the rollout workers call the environment; the submitter not.
        assert matches(source["podSelector"], labels) == (role != "submitter"), role
        assert matches(job_policy["spec"]["podSelector"], labels), role
        assert not matches(env_policy["spec"]["podSelector"], labels), role
    # An environment's pod runs the model's tool calls: the job's policy must not count it
    # as one of the job's pods (that would admit it to the Ray head's job-submission API).
    assert env_pod["rlhf.dev/job"] == "agentic"  # still the job's, for `kubectl get -l`
    job_sources = [peer for rule in job_policy["spec"]["ingress"] for peer in rule["from"]]
    assert not any(matches(p["podSelector"], env_pod) for p in job_sources if "podSelector" in p)
    assert not matches(job_policy["spec"]["podSelector"], env_pod)
    assert not matches(source["podSelector"], env_pod)  # nor other environments' pods


def test_an_environments_labels_cannot_be_taken_by_the_jobs_own_pod_labels() -> None:
    manifest = load(EXAMPLES[0].parent / "agentic-cluster.yaml")
    manifest["spec"]["pods"] = {"labels": {"app.kubernetes.io/component": "head"}}
    with pytest.raises(ValueError, match="are the operator's"):
        parse_job(manifest)


def test_the_reconciler_patches_new_kinds_only_on_real_drift() -> None:
    assert OWNED_FIELDS["Deployment"] == ("spec",) and OWNED_FIELDS["Service"] == ("spec",)
    [service] = of_kind(children(LOOKUP), "Service")
    rendered = service["spec"]
    live = json.loads(json.dumps(rendered))  # as the API server stores it: defaults added
    live |= {"clusterIPs": ["None"], "ipFamilies": ["IPv4"], "type": "ClusterIP",
             "internalTrafficPolicy": "Cluster", "sessionAffinity": "None"}  # fmt: skip
    assert not drifted(live, rendered)
    live["selector"] = {"app": "other"}
    assert drifted(live, rendered)


def test_drift_is_what_a_merge_patch_would_change() -> None:
    assert not drifted({"a": 1, "b": 2}, {"a": 1})  # b: the server's default
    assert drifted({"a": 1}, {"a": 2}) and drifted(None, {"a": 1}) and drifted({}, {"a": 1})
    # Lists are replaced whole: compared item by item, each item as a map.
    assert not drifted([{"x": 1, "default": 0}], [{"x": 1}])
    assert drifted([{"x": 1}, {"x": 2}], [{"x": 1}]) and drifted([{"x": 1}], [{"x": 2}])
    # The API server stores an empty list or map as absent (a policy's egress: []).
    assert not drifted(None, []) and not drifted(None, {}) and drifted([{}], [])
    assert drifted("1", 1) and not drifted("IfNotPresent", "IfNotPresent")
