"""The Helm chart: linted and rendered (no cluster needed), then installed on the real
control plane, where the operator runs with nothing but the chart's ServiceAccount token
and reconciles a job in a namespace that enforces the restricted Pod Security level."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from monitoring.dashboards import DASHBOARDS
from monitoring.grafana import to_json
from rlhf_operator.app.handlers import CHILD_KINDS
from rlhf_operator.controller.kube import KINDS

from .harness import BIN_DIR, REPO_ROOT, ControlPlane
from .operator_process import OperatorProcess
from .scan_manifests import (
    EXCEPTIONS,
    example_manifests,
    excepted,
    findings,
    helm_template,
    rayjob_pods,
)
from .util import (
    eventually,
    get_json,
    kubectl_as,
    provide_example_claims,
    remove_example_claims,
)

CHART = REPO_ROOT / "charts" / "rlhf-operator"
EXAMPLE = "split-8gpu-4-4.yaml"  # fits the control plane's GPU node groups
Manifest = dict[str, Any]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(BIN_DIR / "helm"), *args], capture_output=True, text=True)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def render(*values: str) -> list[Manifest]:
    """`helm template` of the chart with these --set/--set-json arguments."""
    return helm_template("rlhf", *values)


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


# ------------------------------------------------------------------ no cluster needed


# The optional monitoring: the Prometheus Operator's monitors (their CRDs are on the
# control plane) and the Grafana dashboards.
MONITORING = (
    *("--set", "metrics.serviceMonitor.enabled=true"),
    *("--set", "trainerMetrics.podMonitor.enabled=true"),
    *("--set", "dashboards.enabled=true"),
)
EVERYTHING_ON = (
    *("--set", "replicas=3", "--set", "networkPolicy.enabled=true"),
    *("--set-json", 'watchNamespaces=["a","b"]'),
    *MONITORING,
)


@pytest.mark.parametrize("values", [(), EVERYTHING_ON], ids=["defaults", "everything-on"])
def test_the_chart_lints_and_renders(values: tuple[str, ...]) -> None:
    helm("lint", "--strict", str(CHART), *values)
    assert of_kind(render(*values), "Deployment")


def test_the_dashboards_ship_as_configmaps_for_grafanas_sidecar() -> None:
    configmaps = of_kind(render(*MONITORING), "ConfigMap")
    shipped = {name: json.loads(text) for c in configmaps for name, text in c["data"].items()}
    assert shipped == {d.file_name: json.loads(to_json(d)) for d in DASHBOARDS}
    assert all(c["metadata"]["labels"]["grafana_dashboard"] == "1" for c in configmaps)
    assert not of_kind(render(), "ConfigMap")  # off by default


def test_the_chart_carries_the_crds_of_this_version() -> None:
    """`make crds` writes crds/ and copies it into the chart; a drift fails here."""
    names = sorted(p.name for p in (REPO_ROOT / "crds").glob("*.yaml"))
    assert names == sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    _, mismatch, errors = filecmp.cmpfiles(REPO_ROOT / "crds", CHART / "crds", names, shallow=False)
    assert not mismatch and not errors, f"run `make crds`: {mismatch + errors} differ"


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (("--set", "replicas=two"), "/replicas"),
        (("--set", "replica=2"), "'replica'"),
        (("--set-json", 'watchNamespaces=["Not_A_Namespace"]'), "/watchNamespaces/0"),
        (("--set", "metrics.serviceMonitor.enable=true"), "'enable'"),
        (("--set", "image.pullPolicy=Sometimes"), "/image/pullPolicy"),
    ],
)
def test_a_wrong_value_fails_naming_the_key(value: tuple[str, ...], named: str) -> None:
    result = helm("template", "rlhf", str(CHART), *value, check=False)
    assert result.returncode != 0 and named in result.stderr, result.stderr


def rules_of(manifests: list[Manifest]) -> list[Manifest]:
    return [rule for kind in ("ClusterRole", "Role") for r in of_kind(manifests, kind)
            for rule in r["rules"]]  # fmt: skip


# In both modes: `get` on the RayJob CRD alone (the operator checks KubeRay's version).
CRD_READ = {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
            "resourceNames": ["rayjobs.ray.io"], "verbs": ["get"]}  # fmt: skip


def crd_read_only(manifests: list[dict[str, Any]]) -> bool:
    """The ClusterRole that may read the RayJob CRD and nothing else, and its binding."""
    (role,) = [
        r
        for r in of_kind(manifests, "ClusterRole")
        if r["metadata"]["name"].endswith("-kuberay-crd")
    ]
    (binding,) = [b for b in of_kind(manifests, "ClusterRoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]]  # fmt: skip
    return bool(role["rules"] == [CRD_READ] and binding["subjects"])


def test_by_default_one_cluster_role_without_wildcards_or_secrets() -> None:
    manifests = render()
    kinds = sorted(m["kind"] for m in manifests if "Role" in m["kind"])
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
                     "Role", "RoleBinding"]  # fmt: skip
    assert crd_read_only(manifests) and lease_only(manifests)
    for rule in rules_of(manifests):
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], rule
        assert "secrets" not in rule["resources"], rule
        # rayjobs: failed attempts; pods: the workers of a Ray head that was lost
        deletes = {"delete"} if rule["resources"] in (["rayjobs"], ["pods"]) else set()
        assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & (
            set(rule["verbs"]) - deletes
        ), rule
    assert "--all-namespaces" in deployment(manifests)["containers"][0]["args"]


def lease_only(manifests: list[Manifest], namespace: str = "rlhf-system") -> bool:
    """The Role that may create Leases and get or update the release's own (leader
    election), in the release's namespace, and its binding."""
    (role,) = [r for r in of_kind(manifests, "Role") if r["metadata"]["namespace"] == namespace]
    (binding,) = [b for b in of_kind(manifests, "RoleBinding")
                  if b["metadata"]["namespace"] == namespace]  # fmt: skip
    lease = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}
    return bool(
        role["rules"] == [lease | {"verbs": ["create"]},
                          lease | {"resourceNames": [LEASE], "verbs": ["get", "update"]}]
        and binding["roleRef"]["name"] == role["metadata"]["name"] and binding["subjects"]
    )  # fmt: skip


LEASE = "rlhf-rlhf-operator"  # the release's full name, as render() names it


def test_watched_namespaces_get_a_role_each_and_nothing_cluster_wide() -> None:
    manifests = render("--set-json", 'watchNamespaces=["a","b"]')
    assert crd_read_only(manifests)  # the one cluster-wide grant
    assert lease_only(manifests)  # and in the release's namespace, its Lease
    assert (
        len(of_kind(manifests, "ClusterRole")) == len(of_kind(manifests, "ClusterRoleBinding")) == 1
    )
    for kind in ("Role", "RoleBinding"):
        namespaces = sorted(r["metadata"]["namespace"] for r in of_kind(manifests, kind))
        assert namespaces == ["a", "b", "rlhf-system"]
    args = deployment(manifests)["containers"][0]["args"]
    assert args == ["--namespace=a", "--namespace=b", f"--lease={LEASE}",
                    "--lease-namespace=rlhf-system", "--lease-duration=15"]  # fmt: skip


def test_the_rules_cover_every_kind_the_operator_touches() -> None:
    manifests = render("--set", "networkPolicy.enabled=true")
    granted = {(group, resource) for rule in rules_of(manifests) for group in rule["apiGroups"]
               for resource in rule["resources"]}  # fmt: skip
    used = {(k.api_version.rpartition("/")[0], k.plural) for k in KINDS.values()}
    watched = {(group, plural) for group, _, plural in CHILD_KINDS}
    assert used | watched <= granted, f"not granted: {(used | watched) - granted}"
    assert not {g for g, _ in granted} & {"kopf.dev", "zalando.org"}  # no kopf peering: a Lease


def test_every_replica_elects_through_the_lease_and_more_bring_a_disruption_budget() -> None:
    """One replica too: a rolling update starts the new pod beside the old one."""
    one, three = render(), render("--set", "replicas=3", "--set", "leaseDurationSeconds=9")
    assert not of_kind(one, "PodDisruptionBudget")
    assert of_kind(three, "PodDisruptionBudget")[0]["spec"]["minAvailable"] == 1
    for manifests, seconds in ((one, 15), (three, 9)):
        (container,) = deployment(manifests)["containers"]
        assert {f"--lease={LEASE}", f"--lease-duration={seconds}"} <= set(container["args"])
        assert "--standalone" not in container["args"]
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in (
            container["env"]
        )


def deployment(manifests: list[Manifest]) -> Manifest:
    (found,) = of_kind(manifests, "Deployment")
    pod: Manifest = found["spec"]["template"]["spec"]
    return pod


def test_the_operator_pod_meets_the_restricted_pod_security_level() -> None:
    pod = deployment(render())
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {p["httpGet"]["path"] for p in (container["livenessProbe"], container["readinessProbe"])} == {
        "/healthz", "/readyz"
    }  # fmt: skip


def test_the_readme_explains_every_permission() -> None:
    readme = (CHART / "README.md").read_text()
    for rule in rules_of(render("--set", "replicas=2", "--set", "networkPolicy.enabled=true")):
        for resource in rule["resources"]:
            row = next((line for line in readme.splitlines() if f"`{resource}`" in line), None)
            assert row, f"the chart README's permissions table lacks {resource}"
            assert all(verb in row for verb in rule["verbs"]), (row, rule["verbs"])


def test_with_network_policies_the_operator_reaches_the_heads_job_api_and_is_admitted() -> None:
    """Out of the operator's pod: DNS, the API server, and the Ray heads' dashboard port in
    the watched namespaces (how a Ray job ended, where KubeRay's verdict came late); the
    jobs' policies admit the operator's pods there (RLHF_NETWORK_POLICY's "operator")."""
    manifests = render("--set", "networkPolicy.enabled=true", "--set-json", 'watchNamespaces=["a"]')
    (policy,) = of_kind(manifests, "NetworkPolicy")
    *_, heads = policy["spec"]["egress"]
    assert heads["ports"] == [{"protocol": "TCP", "port": 8265}]
    (peer,) = heads["to"]
    assert peer["podSelector"] == {"matchLabels": {"ray.io/node-type": "head"}}
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["a"]
    env = {e["name"]: e.get("value") for e in deployment(manifests)["containers"][0]["env"]}
    operator = json.loads(env["RLHF_NETWORK_POLICY"])["operator"]
    assert operator["podSelector"] == policy["spec"]["podSelector"]
    assert operator["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "rlhf-system"}
    }


def test_the_manifest_scan_reports_what_is_not_excepted() -> None:
    """`make lint` passes its scan because nothing is wrong, not because nothing is seen:
    the operator's pod without its security context, and a job's pods without their
    NetworkPolicy, are reported."""
    exceptions = yaml.safe_load(EXCEPTIONS.read_text())
    manifests = render()
    for container in deployment(manifests)["containers"]:
        del container["securityContext"]
    # An environment's pods come from its Deployment, which its NetworkPolicy targets.
    pods = [m for m in example_manifests() if m["kind"] in ("Pod", "Deployment", "NetworkPolicy")]
    without_policies = [m for m in pods if m["kind"] == "Pod"]
    left = {
        (check, where)
        for check, where, says in findings(manifests + without_policies)
        if not excepted(check, where, says, exceptions)
    }
    assert (
        "container-security-context-readonlyrootfilesystem",
        "Deployment/rlhf-rlhf-operator",
    ) in left
    assert ("pod-networkpolicy", "Pod/colocated-head") in left
    assert not [f for f in findings(pods) if not excepted(*f, exceptions)]


# ------------------------------------------------------------------ on the real control plane


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str  # where the operator's Deployment and ServiceAccount live
    jobs: str  # the namespace it watches (restricted Pod Security)
    other: str  # a namespace it must not touch
    token: str  # the chart's ServiceAccount's, requested from the API server


@pytest.fixture(scope="module")
def release(controlplane: ControlPlane) -> Iterator[Release]:
    cp, suffix = controlplane, uuid.uuid4().hex[:6]
    jobs, other = f"jobs-{suffix}", f"other-{suffix}"
    for namespace in (jobs, other):
        cp.create_namespace(namespace)
    cp.kubectl("label", "namespace", jobs, "pod-security.kubernetes.io/enforce=restricted")
    provide_example_claims(cp, jobs)
    name, namespace = f"rlhf-{suffix}", f"rlhf-system-{suffix}"
    cp.helm("install", name, str(CHART), "--namespace", namespace, "--create-namespace",
            "--set-json", f'watchNamespaces=["{jobs}"]', "--set", "networkPolicy.enabled=true",
            *MONITORING)  # fmt: skip
    account = f"{name}-rlhf-operator"
    token = cp.kubectl("create", "token", account, "-n", namespace).stdout.strip()
    yield Release(name, namespace, jobs, other, token)
    cp.helm("uninstall", name, "--namespace", namespace, check=False)
    cp.kubectl("delete", "namespace", jobs, other, namespace, "--wait=false")
    remove_example_claims(cp, jobs)
    # The job's pods hold GPUs of the shared fake nodes that later tests need: free them
    # now, not after their grace period (kwok's pods run nothing that could need it).
    cp.kubectl("delete", "pods", "--all", "-n", jobs, "--grace-period=0", "--force")


def chart_env(container: Manifest, pod_name: str) -> dict[str, str]:
    """The container's environment, as the kubelet gives it to the pod `pod_name`."""
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert [e["name"] for e in container["env"] if "value" not in e] == ["POD_NAME"]
    return env | {"POD_NAME": pod_name}


@pytest.fixture(scope="module")
def chart_operator(
    controlplane: ControlPlane, release: Release, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator as the chart runs it, logged in with the chart's token only."""
    cp = controlplane
    kubeconfig = tmp_path_factory.mktemp("sa") / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "cp", "cluster": {"server": cp.server,
                                                "certificate-authority": str(cp.ca_file)}}],
        "users": [{"name": "sa", "user": {"token": release.token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "cp", "user": "sa"}}],
    }))  # fmt: skip
    # The settings the chart gives the operator's container, as it gives them.
    manifest = cp.helm("get", "manifest", release.name, "-n", release.namespace).stdout
    (deployment,) = of_kind([d for d in yaml.safe_load_all(manifest) if d], "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = chart_env(container, pod_name="chart-operator")
    op = OperatorProcess(cp, "chart-operator", *container["args"], kubeconfig=kubeconfig, env=env)
    yield op.start()
    op.stop()


def test_with_only_the_charts_permissions_a_job_runs_in_a_restricted_namespace(
    controlplane: ControlPlane, release: Release, chart_operator: OperatorProcess
) -> None:
    """Any permission the chart lacks makes a reconcile or a watch fail (403), and any
    rendered pod that is not restricted is refused by the API server's admission."""
    cp = controlplane
    cp.kubectl("apply", "-n", release.jobs, "-f", str(REPO_ROOT / "examples" / EXAMPLE))
    name = yaml.safe_load((REPO_ROOT / "examples" / EXAMPLE).read_text())["metadata"]["name"]

    def ready_pools() -> bool:
        status = get_json(cp, "rlhfjob", name, "-n", release.jobs).get("status") or {}
        return status.get("poolsReady") == "2/2"

    eventually(ready_pools, "both pools' pods to run, admitted as restricted")

    # KubeRay starts the submitter only once Ray answers, which kwok's pods never do: the
    # API server checks a pod made from its template (and the others) without creating it.
    pods = yaml.safe_dump_all(rayjob_pods(get_json(cp, "rayjob", name, "-n", release.jobs)))
    cp.kubectl("create", "--dry-run=server", "-n", release.jobs, "-f", "-", input=pods)
    # The namespace does refuse a pod that is not restricted (so admission was checked).
    refused = cp.kubectl("run", "unrestricted", "--image=busybox", "-n", release.jobs,
                         "--dry-run=server", check=False)  # fmt: skip
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr
    policy = get_json(cp, "networkpolicy", name, "-n", release.jobs)
    # The job's Ray pods, by component: not its environments' pods (model-written tool calls).
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"rlhf.dev/job": name},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                              "values": ["head", "worker", "submitter"]}],
    }  # fmt: skip
    log = chart_operator.log_path.read_text()
    # A refusal reads "Forbidden" (the client's "Reason: Forbidden", kopf's
    # APIForbiddenError); a bare "403" once matched a timestamp's milliseconds.
    assert "forbidden" not in log.lower(), log[-3000:]
    # Each child made at the first try: a RoleBinding sent before its Role exists is
    # refused (404, the operator may not `bind`), failing the reconcile once.
    assert "failed (attempt" not in log, log[-3000:]


def can_i(cp: ControlPlane, release: Release, verb: str, resource: str, namespace: str) -> bool:
    """Whether the chart's ServiceAccount may (asked with its own token)."""
    answer = kubectl_as(cp, release.token, "auth", "can-i", verb, resource, "-n", namespace)
    return answer.stdout.strip() == "yes"


def test_the_operator_cannot_read_secrets_or_touch_other_namespaces(
    controlplane: ControlPlane, release: Release
) -> None:
    cp = controlplane
    assert can_i(cp, release, "create", "rayjobs.ray.io", release.jobs)  # the check can say yes
    for verb in ("get", "list", "watch"):
        assert not can_i(cp, release, verb, "secrets", release.jobs)
    for verb, resource in (("list", "rlhfjobs.rlhf.dev"), ("create", "configmaps"),
                           ("create", "rayjobs.ray.io"), ("list", "pods")):  # fmt: skip
        assert not can_i(cp, release, verb, resource, release.other), (verb, resource)
    assert not can_i(cp, release, "delete", "configmaps", release.jobs)


def test_the_monitors_and_dashboards_are_accepted_by_the_api_server(
    controlplane: ControlPlane, release: Release
) -> None:
    fullname = f"{release.name}-rlhf-operator"
    for kind, name in (("servicemonitor", fullname), ("podmonitor", f"{fullname}-trainers")):
        found = controlplane.kubectl("get", kind, "-n", release.namespace, "-o", "name").stdout
        assert found.split() == [f"{kind}.monitoring.coreos.com/{name}"], found
    found = controlplane.kubectl("get", "configmaps", "-n", release.namespace, "-o", "name",
                                 "-l", "grafana_dashboard=1").stdout  # fmt: skip
    assert sorted(found.split()) == [
        f"configmap/{fullname}-dashboard-{name}" for name in ("operator", "pools", "training")
    ]


def test_installing_the_same_release_twice_fails_and_changes_nothing(
    controlplane: ControlPlane, release: Release
) -> None:
    again = controlplane.helm(
        "install", release.name, str(CHART), "--namespace", release.namespace, check=False
    )
    assert again.returncode != 0 and "cannot re-use a name" in again.stderr, again.stderr
    history = controlplane.helm("history", release.name, "-n", release.namespace, "-o", "json")
    assert len(json.loads(history.stdout)) == 1


# Every kind the chart may create, with the instance label: what uninstall must remove.
CHART_KINDS = "deployments,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets"
CLUSTER_KINDS = "clusterroles,clusterrolebindings"


def released(cp: ControlPlane, name: str) -> list[str]:
    """kind/name of every object of release `name`, in any namespace."""
    found = []
    for kinds, scope in ((CHART_KINDS, ("-A",)), (CLUSTER_KINDS, ())):
        out = cp.kubectl("get", kinds, *scope, "-l", f"app.kubernetes.io/instance={name}",
                         "-o", "name").stdout  # fmt: skip
        found += out.split()
    return found


def test_upgrade_follows_the_values_and_uninstall_leaves_no_orphans(
    controlplane: ControlPlane, release: Release
) -> None:
    cp, name, namespace = controlplane, f"{release.name}-b", f"{release.namespace}-b"
    cp.helm("install", name, str(CHART), "-n", namespace, "--create-namespace")
    assert sorted(k.split("/")[0] for k in released(cp, name) if "role" in k) == [
        "clusterrole.rbac.authorization.k8s.io",
        "clusterrole.rbac.authorization.k8s.io",  # the RayJob CRD's, in both modes
        "clusterrolebinding.rbac.authorization.k8s.io",
        "clusterrolebinding.rbac.authorization.k8s.io",
        "role.rbac.authorization.k8s.io",  # the Lease's, in both modes
        "rolebinding.rbac.authorization.k8s.io",
    ]
    cp.helm("upgrade", name, str(CHART), "-n", namespace, "--set", "replicas=2",
            "--set-json", f'watchNamespaces=["{release.other}"]')  # fmt: skip
    now = released(cp, name)
    cluster_wide = [k for k in now if k.startswith("clusterrole")]
    assert all(k.endswith("-kuberay-crd") for k in cluster_wide), now  # narrowed to a Role
    for kind in ("role.", "rolebinding.", "poddisruptionbudget."):
        assert any(k.startswith(kind) for k in now), (kind, now)
    assert len([k for k in now if k.startswith("role.")]) == 2, now  # the namespace's, the Lease's
    cp.helm("uninstall", name, "-n", namespace, "--wait")
    assert released(cp, name) == []


def test_an_existing_crd_of_another_version_stops_the_install(
    controlplane: ControlPlane, tmp_path: Path
) -> None:
    """A copy of the chart under a group of its own (the real CRD stays untouched):
    installed once, then again as a chart whose CRD has moved on to v1alpha2."""
    cp, prefix = controlplane, f"t{uuid.uuid4().hex[:6]}"
    crd = f"rlhfjobs.{prefix}.rlhf.dev"
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    crd_file = chart / "crds" / "rlhfjobs.yaml"
    crd_file.write_text(crd_file.read_text().replace("rlhf.dev", f"{prefix}.rlhf.dev"))
    cp.helm("install", "first", str(chart), "-n", f"{prefix}-a", "--create-namespace")
    crd_file.write_text(crd_file.read_text().replace("name: v1alpha1", "name: v1alpha2"))
    second = cp.helm("install", "second", str(chart), "-n", f"{prefix}-b", "--create-namespace",
                     check=False)  # fmt: skip
    assert second.returncode != 0, second.stdout
    assert f"{crd} serves v1alpha1, but this chart's operator needs v1alpha2" in second.stderr
    assert released(cp, "second") == []
    served = get_json(cp, "crd", crd)["spec"]["versions"]
    assert [(v["name"], v["served"]) for v in served] == [("v1alpha1", True)]  # unchanged
    cp.helm("uninstall", "first", "-n", f"{prefix}-a")
    # Clean-up only: the API server finalizes a deleted CRD in its own time (once over
    # two minutes on a busy CI machine), and nothing here waits for it.
    cp.kubectl("delete", "crd", crd, "--wait=false")
