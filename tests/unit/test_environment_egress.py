"""Where an environment's pods may connect (issue 72): `egress: true` is the internet
without the cluster's ranges and the metadata addresses, `egressTo` an allow-list; a job
with such an environment gets a policy that keeps environments' pods off its Ray pods,
with or without the chart's peers. And the environment's placement fields and its
disruption budget.

The policies are read with a small evaluator of ipBlocks and label selectors (`allows`,
`matches`): what a policy-enforcing plugin would do with them is shown on the real node
(tests/controlplane/test_network_policies.py)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_operator.api.crd import build_crd
from rlhf_operator.api.validation import parse_job
from rlhf_operator.render.children import JobRef, render_children
from rlhf_operator.render.meta import labels
from rlhf_operator.render.network import (
    CLUSTER_RANGES,
    KUBE_DNS,
    METADATA_ADDRESSES,
    NetworkAccess,
    Peers,
)
from tests.controlplane.harness import BIN_DIR
from tests.controlplane.scan_manifests import helm_template
from tests.rendered import matches
from tests.unit.celcheck import assert_refused
from tests.unit.conftest import EXAMPLES, load

Obj = dict[str, Any]
JOB = JobRef("agentic", "team-a", uid="uid-agentic")
LOOKUP = {"name": "lookup", "serve": "rlhf_env.toys:LetterLookup"}
VALUES = Path(__file__).parents[2] / "charts" / "rlhf-operator" / "values.yaml"
ENV_POD = {**labels(JOB, "environment"), "rlhf.dev/environment": "lookup"}
# Addresses an environment with `egress: true` may not reach, with the default ranges.
CLUSTER_ADDRESSES = [
    "10.244.0.5",  # a pod
    "10.96.0.1",  # the kubernetes Service (the API server)
    "172.20.0.10",
    "192.168.1.1",
    "100.64.0.1",
    "169.254.20.10",  # NodeLocal DNSCache
    "fd12::1",
    "fe80::1",
    "169.254.169.254",  # the metadata addresses
    "fd00:ec2::254",
]
INTERNET = ["8.8.8.8", "203.0.113.7", "2001:4860:4860::8888"]


def manifest(*environments: Obj) -> Obj:
    job = load(EXAMPLES[0].parent / "agentic-cluster.yaml")
    job["spec"]["environments"] = list(environments)
    job["spec"]["generation"]["multiTurn"]["environment"] = environments[0]["name"]
    return job


def children(*environments: Obj, network: NetworkAccess | None = None) -> dict[str, Obj]:
    """The agentic example's children with these environments, by kind/name."""
    objects = render_children(JOB, parse_job(manifest(*environments)).spec, network)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


def egress_of(objects: dict[str, Obj]) -> list[Obj]:
    rules: list[Obj] = objects["NetworkPolicy/agentic-env-lookup"]["spec"]["egress"]
    return rules


def in_block(block: Obj, address: str) -> bool:
    ip = ipaddress.ip_address(address)

    def inside(cidr: str) -> bool:
        network = ipaddress.ip_network(cidr)
        return ip.version == network.version and ip in network

    return inside(block["cidr"]) and not any(map(inside, block.get("except", [])))


def allows(rules: list[Obj], address: str, port: int) -> bool:
    """Whether an egress rule admits a TCP connection to address:port (by its ipBlocks:
    the address is no pod of a selector here)."""
    for rule in rules:
        ports = rule.get("ports")
        if ports and not any(p == {"protocol": "TCP", "port": port} for p in ports):
            continue
        if any(in_block(peer["ipBlock"], address) for peer in rule["to"] if "ipBlock" in peer):
            return True
    return False


def admits_pod(policy: Obj, pod: dict[str, str]) -> bool:
    """Whether the policy's ingress admits a pod of this namespace with these labels (a
    namespaceSelector of {} or none matches it)."""
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            namespaces = peer.get("namespaceSelector")
            in_namespace = "podSelector" in peer and namespaces in (None, {})
            if in_namespace and matches(peer["podSelector"], pod):
                return True
    return False


def dns_rules(rules: list[Obj]) -> list[Obj]:
    return [r for r in rules if any("podSelector" in peer for peer in r["to"])]


@pytest.mark.parametrize("address", CLUSTER_ADDRESSES)
def test_egress_true_reaches_no_address_of_the_cluster_nor_the_metadata(address: str) -> None:
    rules = egress_of(children(LOOKUP | {"egress": True}))
    assert not allows(rules, address, 443)
    assert not allows(rules, address, 6443) and not allows(rules, address, 80)


@pytest.mark.parametrize("address", INTERNET)
def test_egress_true_reaches_the_internet_on_any_port(address: str) -> None:
    rules = egress_of(children(LOOKUP | {"egress": True}))
    assert allows(rules, address, 443) and allows(rules, address, 22)


def test_an_environment_with_egress_asks_only_the_clusters_dns_pods() -> None:
    rules = egress_of(children(LOOKUP | {"egress": True}))
    assert dns_rules(rules) == [
        {
            "to": [KUBE_DNS],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        }
    ]
    # Nothing else names pods: the internet rule is ipBlocks only (a pod IP is in the ranges).
    assert len(rules) == 2 and all("ipBlock" in peer for peer in rules[0]["to"])


def test_the_charts_ranges_decide_what_is_the_cluster_but_never_the_metadata() -> None:
    network = NetworkAccess(cluster_ranges=("10.0.0.0/16", "fd12::/16"))
    rules = egress_of(children(LOOKUP | {"egress": True}, network=network))
    assert allows(rules, "10.1.0.1", 443) and allows(rules, "192.168.1.1", 443)
    assert not allows(rules, "10.0.3.4", 443) and not allows(rules, "fd12::1", 443)
    assert not allows(rules, "169.254.169.254", 80) and not allows(rules, "fd00:ec2::254", 80)
    # The chart's metadata addresses, where a cloud has others, out of egressTo rules too
    # (a rule of them alone gives nothing).
    other_cloud = NetworkAccess(metadata=("100.64.1.1/32",))
    to = [{"cidr": "100.64.1.1/32"}, {"cidr": "100.64.0.0/10"}, {"cidr": "169.254.0.0/16"}]
    rules = egress_of(children(LOOKUP | {"egress": True, "egressTo": to}, network=other_cloud))
    assert not allows(rules, "100.64.1.1", 80) and allows(rules, "100.64.0.2", 80)
    assert allows(rules, "169.254.169.254", 80)  # this chart's list leaves it out
    assert len(rules) == 4  # the internet, the two ranges and DNS
    # A family the ranges cover whole gets no internet at all, not the whole of it.
    everything = NetworkAccess(cluster_ranges=("0.0.0.0/0",))
    rules = egress_of(children(LOOKUP | {"egress": True}, network=everything))
    assert not allows(rules, "8.8.8.8", 443) and allows(rules, "2001:4860:4860::8888", 443)


def test_egress_to_allows_its_cidrs_on_its_ports_and_dns_and_nothing_else() -> None:
    database = {"cidr": "10.1.2.0/24", "ports": [5432]}
    link_local = {"cidr": "169.254.0.0/16"}  # holds the metadata address: taken out
    rules = egress_of(children(LOOKUP | {"egressTo": [database, link_local]}))
    assert allows(rules, "10.1.2.3", 5432) and not allows(rules, "10.1.2.3", 22)
    assert not allows(rules, "10.1.3.1", 5432) and not allows(rules, "8.8.8.8", 443)
    assert allows(rules, "169.254.1.1", 80) and not allows(rules, "169.254.169.254", 80)
    assert len(dns_rules(rules)) == 1
    both = egress_of(children(LOOKUP | {"egress": True, "egressTo": [database]}))
    assert allows(both, "10.1.2.3", 5432) and allows(both, "8.8.8.8", 443)


def test_the_charts_default_ranges_and_dns_are_the_operators() -> None:
    values = yaml.safe_load(VALUES.read_text())["networkPolicy"]
    assert values["enabled"] is False
    assert tuple(values["clusterRanges"]) == CLUSTER_RANGES and values["dns"] == [KUBE_DNS]
    assert tuple(values["metadataAddresses"]) == METADATA_ADDRESSES
    assert {"169.254.169.254/32", "fd00:ec2::254/128"} <= set(METADATA_ADDRESSES)


@pytest.mark.parametrize("enabled", ["false", "true"])
def test_the_chart_passes_its_ranges_whether_policies_are_enabled_or_not(enabled: str) -> None:
    """The environments' policies are rendered for every job: their ranges must arrive."""
    if not (BIN_DIR / "helm").exists():
        pytest.skip("no helm: make controlplane builds it")
    ranges = '["10.96.0.0/12","10.244.0.0/16"]'
    manifests = helm_template("r", "--set", f"networkPolicy.enabled={enabled}",
                              "--set-json", f"networkPolicy.clusterRanges={ranges}")  # fmt: skip
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    access = NetworkAccess.from_env(environ)
    assert access.cluster_ranges == ("10.96.0.0/12", "10.244.0.0/16")
    assert access.dns == (KUBE_DNS,) and access.metadata == METADATA_ADDRESSES
    assert (access.peers is not None) == (enabled == "true")


ENVIRONMENT_CASES = [
    ({"egressTo": [{"cidr": "10.1.2.3/24"}]}, "egressTo[0].cidr", "host bits", False),
    ({"egressTo": [{"cidr": "example.com"}]}, "egressTo[0].cidr", "must be a CIDR", False),
    ({"egressTo": [{"cidr": "169.254.169.254/32"}]}, "egressTo[0].cidr", "metadata address", False),
    ({"egressTo": [{"cidr": "10.0.0.0/8", "ports": [0]}]}, "egressTo[0].ports[0]", "greater than", False),
    ({"egressTo": []}, "egressTo", "at least 1 item", False),
    ({"runtimeClassName": "G_Visor"}, "runtimeClassName", "should match pattern", False),
    ({"tolerations": [{"operator": "Sometimes"}]}, "tolerations[0].operator", "'Exists' or 'Equal'", False),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "path", "words", "cel_too"), ENVIRONMENT_CASES)
def test_bad_egress_and_placement_are_refused_naming_the_field(
    fields: Obj, path: str, words: str, cel_too: bool
) -> None:
    assert_refused(manifest(LOOKUP | fields), f"spec.environments[0].{path}", words, cel_too)


@pytest.mark.parametrize(
    "fields", [{"egressTo": [{"cidr": "10.0.0.0/8"}]}, {"runtimeClassName": "gvisor"},
               {"nodeSelector": {"sandbox": "true"}}, {"tolerations": [{"operator": "Exists"}]}]
)  # fmt: skip
def test_egress_and_placement_are_refused_for_an_environment_at_a_url(fields: Obj) -> None:
    at_url = {"name": "lookup", "url": "http://lookup.tools.svc:8000"} | fields
    (name,) = fields
    assert_refused(manifest(at_url), "spec.environments[0].url", f"(got {name})", True)


def test_the_crd_keeps_egress_a_boolean_and_egress_to_a_list_of_cidrs() -> None:
    """Structural: one type per field (a bool-or-list would not be)."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    environment = schema["properties"]["spec"]["properties"]["environments"]["items"]
    fields = environment["properties"]
    assert fields["egress"]["type"] == "boolean"
    rule = fields["egressTo"]["items"]["properties"]
    assert rule["cidr"] == {"type": "string", "format": "cidr", "maxLength": 43,
                            "description": rule["cidr"]["description"]}  # fmt: skip
    assert rule["ports"]["items"]["type"] == "integer"


@pytest.mark.parametrize("fields", [{"egress": True}, {"egressTo": [{"cidr": "10.1.0.0/16"}]}])
def test_without_the_charts_peers_a_job_whose_environment_has_egress_refuses_environments(
    fields: Obj,
) -> None:
    objects = children(LOOKUP | fields)
    policy = objects["NetworkPolicy/agentic"]
    assert policy["metadata"]["ownerReferences"][0]["name"] == "agentic"
    assert list(objects)[-1] == "RayJob/agentic"  # the policy before the Ray pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for component in ("head", "worker", "submitter"):
        assert matches(policy["spec"]["podSelector"], labels(JOB, component))
    assert not matches(policy["spec"]["podSelector"], ENV_POD)
    # Every pod but an environment's (of any job) gets in; the job's own, KubeRay's,
    # Prometheus' and this operator's included.
    assert not admits_pod(policy, ENV_POD)
    other_jobs_environment = {**labels(JobRef("b", "team-a", "u"), "environment"),
                              "rlhf.dev/environment": "calc"}  # fmt: skip
    assert not admits_pod(policy, other_jobs_environment)
    for pod in (labels(JOB, "worker"), {"app.kubernetes.io/name": "kuberay-operator"},
                {"app.kubernetes.io/name": "prometheus"}, {}):  # fmt: skip
        assert admits_pod(policy, pod), pod
    # Addresses outside the cluster (a load balancer's clients) too, but none in its ranges:
    # a plugin that matches pod addresses against an ipBlock must not let environments in.
    (rule,) = policy["spec"]["ingress"]
    ingress = [{"to": rule["from"]}]
    assert allows(ingress, "8.8.8.8", 8265) and allows(ingress, "2001:db8::1", 8265)
    for address in CLUSTER_ADDRESSES:
        assert not allows(ingress, address, 8265), address


def test_a_job_without_egress_gets_no_policy_of_its_own_unless_the_chart_names_peers() -> None:
    assert "NetworkPolicy/agentic" not in children(LOOKUP)
    assert "NetworkPolicy/agentic" not in children({"name": "lookup", "url": "http://l:8000"})
    peers = Peers({"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
                  {"podSelector": {"matchLabels": {"app": "kuberay"}}})  # fmt: skip
    for fields in ({}, {"egress": True}):
        policy = children(LOOKUP | fields, network=NetworkAccess(peers))["NetworkPolicy/agentic"]
        assert len(policy["spec"]["ingress"]) == 3  # the peers' policy (test_render.py)
        assert not admits_pod(policy, ENV_POD)


def test_placement_fields_reach_the_environments_pods() -> None:
    toleration = {"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}
    placed = LOOKUP | {"runtimeClassName": "gvisor", "nodeSelector": {"pool": "sandbox"},
                       "tolerations": [toleration]}  # fmt: skip
    pod = children(placed)["Deployment/agentic-env-lookup"]["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["nodeSelector"] == {"pool": "sandbox"} and pod["tolerations"] == [toleration]
    plain = children(LOOKUP)["Deployment/agentic-env-lookup"]["spec"]["template"]["spec"]
    assert not {"runtimeClassName", "nodeSelector", "tolerations"} & set(plain)


def test_an_environment_of_several_replicas_gets_a_disruption_budget_of_one() -> None:
    objects = children(LOOKUP | {"replicas": 3})
    budget = objects["PodDisruptionBudget/agentic-env-lookup"]
    deployment = objects["Deployment/agentic-env-lookup"]
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
    assert budget["metadata"]["ownerReferences"] == deployment["metadata"]["ownerReferences"]
    assert matches(budget["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert not any(k.startswith("PodDisruptionBudget/") for k in children(LOOKUP))
