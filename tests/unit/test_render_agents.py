"""The agents the operator runs for a job: a Deployment, a Service and a NetworkPolicy
each, secured as an environment's; their policy admits the job's Ray pods and lets them
reach the rollout pool's gateway, DNS and what egress allows, nothing else of the job;
and the rollout pods admit the agents on the gateway's port alone."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_operator.render.agents import AGENT_LABEL, render_stopped_agents
from rlhf_operator.render.children import JobRef, render_children
from rlhf_operator.render.meta import COMPONENT_LABEL
from rlhf_operator.render.network import KUBE_DNS, NetworkAccess, Peers
from rlhf_operator.render.pod import container_security, pod_security
from rlhf_trainer.api.agents import GATEWAY_PORT
from rlhf_trainer.api.names import POOL_LABEL
from tests.rendered import matches, named, of_kind, pod_labels
from tests.unit.conftest import EXAMPLES, load

Obj = dict[str, Any]
JOB = JobRef("agentic", "team-a", uid="uid-agentic")
CODER = {"name": "coder", "serve": "agents.coder:run"}
PEERS = NetworkAccess(
    Peers(
        prometheus={"namespaceSelector": {"matchLabels": {"team": "monitoring"}}},
        kuberay={"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}},
    )
)


def manifest(*agents: Obj) -> Obj:
    """The agentic example, its episodes run by these agents (the first) instead of its
    environment; its rollouts on a pool of their own."""
    job = load(EXAMPLES[0].parent / "agentic-cluster.yaml")
    spec = job["spec"]
    spec["pools"].append({"name": "gen", "device": "cpu", "gpusPerNode": 1})
    spec["roles"]["rollout"] = "gen"
    spec["environments"] = []
    spec["agents"] = list(agents)
    del spec["generation"]["multiTurn"]
    spec["generation"]["agent"] = {"agent": agents[0]["name"]}
    spec["models"]["reward"] = {"function": "toy_copy"}
    spec["pods"] = {"env": [{"name": "HF_TOKEN", "value": "secret"}]}
    return job


def children(*agents: Obj, network: NetworkAccess | None = None) -> list[Obj]:
    return render_children(JOB, parse_job(manifest(*agents)).spec, network)


def test_a_served_agent_runs_the_function_on_the_jobs_image_secured_and_owned() -> None:
    objects = children(CODER | {"replicas": 2})
    kinds = [o["kind"] for o in objects]
    assert kinds[-1] == "RayJob"  # still last: its pods need the rest
    deployment = named(objects, "Deployment", "agentic-agent-coder")
    for obj in (deployment, named(objects, "Service", "agentic-agent-coder"),
                named(objects, "NetworkPolicy", "agentic-agent-coder")):  # fmt: skip
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        [owner] = meta["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "RLHFJob",
            "uid-agentic",
            True,
        )
        assert meta["labels"][COMPONENT_LABEL] == "agent"
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "rlhf-trainer:0.1.0-cpu"  # the job's spec.image
    assert container["command"] == [
        "python", "-m", "rlhf_env", "agent", "agents.coder:run", "--host", "0.0.0.0", "--port", "8000",
        "--max-episodes", "8",  # each of 2 replicas' share of maxConcurrentEpisodes (16)
    ]  # fmt: skip
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "serve"}
    assert container["ports"] == [{"name": "serve", "containerPort": 8000, "protocol": "TCP"}]
    # Restricted: non-root, no privilege, no capabilities, a read-only root filesystem.
    assert pod["securityContext"] == pod_security()
    assert container["securityContext"] == {**container_security(), "readOnlyRootFilesystem": True}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # No token, no service links, none of the job's env (HF_TOKEN), none of its volumes.
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod
    assert pod["enableServiceLinks"] is False
    assert "env" not in container and "envFrom" not in container
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert "secret" not in str(deployment)


def test_several_replicas_get_a_disruption_budget_one_none() -> None:
    objects = children(CODER | {"replicas": 2}, {"name": "one", "serve": "agents.one:run"})
    [budget] = of_kind(objects, "PodDisruptionBudget")
    assert budget["metadata"]["name"] == "agentic-agent-coder"
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"rlhf.dev/job": "agentic", AGENT_LABEL: "coder"}},
    }


def test_an_agent_with_its_own_image_command_port_and_env() -> None:
    agent = {"name": "bash", "image": "bash-agent:1", "command": ["bash-agent", "--fast"],
             "port": 9000, "resources": {"cpu": 2}, "env": [{"name": "MODE", "value": "x"}]}  # fmt: skip
    objects = children(agent)
    [container] = named(objects, "Deployment", "agentic-agent-bash")["spec"]["template"]["spec"][
        "containers"
    ]
    assert (container["image"], container["command"]) == ("bash-agent:1", ["bash-agent", "--fast"])
    assert container["env"] == [{"name": "MODE", "value": "x"}]
    assert container["resources"]["limits"] == {
        "cpu": "2",
        "memory": "1Gi",
        "ephemeral-storage": "512Mi",
    }
    service = named(objects, "Service", "agentic-agent-bash")["spec"]
    assert service["ports"] == [
        {"name": "serve", "port": 9000, "targetPort": "serve", "protocol": "TCP"}
    ]
    assert service["clusterIP"] == "None"  # headless: the trainer places each episode
    assert matches({"matchLabels": service["selector"]}, pod_labels(objects)["agentic-agent-bash"])
    policy = named(objects, "NetworkPolicy", "agentic-agent-bash")["spec"]
    assert policy["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9000}]


def test_an_agent_may_run_sandboxed_on_nodes_of_its_own() -> None:
    toleration = {"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}
    agent = CODER | {"runtimeClassName": "gvisor", "nodeSelector": {"pool": "sandbox"},
                     "tolerations": [toleration]}  # fmt: skip
    pod = named(children(agent), "Deployment", "agentic-agent-coder")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["nodeSelector"] == {"pool": "sandbox"} and pod["tolerations"] == [toleration]
    plain = named(children(CODER), "Deployment", "agentic-agent-coder")["spec"]["template"]["spec"]
    assert not {"runtimeClassName", "nodeSelector", "tolerations"} & plain.keys()


def test_an_agent_at_its_url_gets_nothing_rendered() -> None:
    objects = children({"name": "remote", "url": "http://remote.team.svc:8000"}, network=PEERS)
    assert not [o for o in objects if "-agent-" in o["metadata"]["name"]]
    assert not [o for o in objects if o["metadata"]["name"].endswith("-gateway")]


def test_the_agents_policy_admits_the_ray_pods_and_reaches_only_the_gateway_and_dns() -> None:
    objects = children(CODER)
    labels = pod_labels(objects)
    policy = named(objects, "NetworkPolicy", "agentic-agent-coder")["spec"]
    assert matches(policy["podSelector"], labels["agentic-agent-coder"])
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    # Ingress: the head and the pools (the trainer's POST /episodes), on its port only.
    [ingress] = policy["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 8000}]
    [source] = ingress["from"]
    admitted = {name for name, pod in labels.items() if matches(source["podSelector"], pod)}
    assert admitted == {"head", "policy", "value", "gen"}
    # Egress: the rollout pool's pods on the gateway's port, and DNS; nothing else.
    gateway, dns = policy["egress"]
    assert gateway["ports"] == [{"protocol": "TCP", "port": GATEWAY_PORT}]
    [peer] = gateway["to"]
    reached = {name for name, pod in labels.items() if matches(peer["podSelector"], pod)}
    assert reached == {"gen"}  # not the head, the other pools, the submitter, the agent
    assert dns["to"] == [KUBE_DNS] and {p["port"] for p in dns["ports"]} == {53}


def test_egress_adds_the_internet_and_egress_to_its_cidrs_as_an_environments() -> None:
    objects = children(
        CODER | {"egress": True, "egressTo": [{"cidr": "10.1.0.0/16", "ports": [5432]}]}
    )
    egress = named(objects, "NetworkPolicy", "agentic-agent-coder")["spec"]["egress"]
    assert egress[0]["ports"] == [{"protocol": "TCP", "port": GATEWAY_PORT}]
    blocks = [peer["ipBlock"] for rule in egress for peer in rule["to"] if "ipBlock" in peer]
    internet = next(b for b in blocks if b["cidr"] == "0.0.0.0/0")
    assert "10.0.0.0/8" in internet["except"] and "169.254.0.0/16" in internet["except"]
    assert {"cidr": "10.1.0.0/16"} in blocks
    database = next(r for r in egress if {"ipBlock": {"cidr": "10.1.0.0/16"}} in r["to"])
    assert database["ports"] == [{"protocol": "TCP", "port": 5432}]
    assert sum(KUBE_DNS in rule["to"] for rule in egress) == 1  # DNS once


@pytest.mark.parametrize("network", [None, NetworkAccess()], ids=["no-network", "no-peers"])
def test_without_the_jobs_own_policy_no_gateway_policy_isolates_the_rollout_pods(
    network: NetworkAccess | None,
) -> None:
    objects = children(CODER, network=network)
    assert not [o for o in objects if o["metadata"]["name"] == "agentic-gateway"]
    assert not [o for o in of_kind(objects, "NetworkPolicy") if o["metadata"]["name"] == "agentic"]


def test_beside_the_guard_of_environments_with_egress_the_gateway_policy_is_rendered_too() -> None:
    job = manifest(CODER)
    tools = {"name": "tools", "serve": "rlhf_env.toys:LetterLookup", "egress": True}
    job["spec"]["environments"] = [tools]
    objects = render_children(JOB, parse_job(job).spec, NetworkAccess())  # no peers
    names = {o["metadata"]["name"] for o in of_kind(objects, "NetworkPolicy")}
    assert {"agentic", "agentic-gateway"} <= names  # the guard isolates the rollout pods


def test_an_agent_with_egress_gets_the_guard_that_refuses_agents_and_environments() -> None:
    # No peers: an agent with egressTo a range that holds the job's pods could reach the
    # Ray head, so the job's pods admit every pod but the agents' and environments'.
    agent = CODER | {"egressTo": [{"cidr": "10.0.0.0/8"}]}
    objects = children(agent, network=NetworkAccess())
    guard = named(objects, "NetworkPolicy", "agentic")["spec"]
    [rule] = guard["ingress"]
    [pods, *addresses] = rule["from"]
    assert pods["namespaceSelector"] == {} and addresses  # any namespace; the internet
    refused = {e["key"] for e in pods["podSelector"]["matchExpressions"]}
    assert refused == {AGENT_LABEL, "rlhf.dev/environment"}
    assert all(e["operator"] == "DoesNotExist" for e in pods["podSelector"]["matchExpressions"])
    assert AGENT_LABEL in pod_labels(objects)["agentic-agent-coder"]
    # ... and the gateway's policy lets the agents through to the gateway alone.
    assert named(objects, "NetworkPolicy", "agentic-gateway")
    # An agent that reaches only the gateway needs no guard.
    assert not [o for o in of_kind(children(CODER, network=NetworkAccess()), "NetworkPolicy")
                if o["metadata"]["name"] == "agentic"]  # fmt: skip


def test_with_the_jobs_policy_the_rollout_pods_admit_the_agents_on_the_gateways_port_alone() -> (
    None
):
    objects = children(CODER, {"name": "writer", "serve": "agents.writer:run"}, network=PEERS)
    labels = pod_labels(objects)
    gateway = named(objects, "NetworkPolicy", "agentic-gateway")
    assert gateway["metadata"]["ownerReferences"][0]["uid"] == "uid-agentic"
    spec = gateway["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # adds to the job's policy; no egress rule
    selected = {name for name, pod in labels.items() if matches(spec["podSelector"], pod)}
    assert selected == {"gen"}
    assert labels["gen"][POOL_LABEL] == "gen"
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": GATEWAY_PORT}]
    [source] = rule["from"]
    admitted = {name for name, pod in labels.items() if matches(source["podSelector"], pod)}
    assert admitted == {"agentic-agent-coder", "agentic-agent-writer"}
    # The job's own policy does not admit the agents to anything.
    job_policy = named(objects, "NetworkPolicy", "agentic")["spec"]
    own = job_policy["ingress"][0]["from"][0]["podSelector"]
    assert not any(matches(own, labels[n]) for n in ("agentic-agent-coder", "agentic-agent-writer"))
    assert len(of_kind(objects, "NetworkPolicy")) == 4  # the job's, two agents', the gateway's


def test_each_replica_serves_its_share_of_the_episodes_rounded_up() -> None:
    agent = CODER | {"replicas": 3, "maxConcurrentEpisodes": 10}
    [container] = named(children(agent), "Deployment", "agentic-agent-coder")["spec"]["template"][
        "spec"
    ]["containers"]
    assert container["command"][-2:] == ["--max-episodes", "4"]


def test_the_trainer_reaches_each_agent_at_its_service() -> None:
    spec = parse_job(manifest(CODER | {"port": 9000, "maxConcurrentEpisodes": 4})).spec
    [coder] = spec.job_config(JOB.name).agents
    assert (coder.url, coder.serve, coder.max_concurrent_episodes) == (
        "http://agentic-agent-coder:9000", None, 4,
    )  # fmt: skip


def test_an_ended_jobs_agents_are_scaled_to_zero() -> None:
    spec = parse_job(
        manifest(CODER | {"replicas": 3}, {"name": "r", "url": "http://r.t.svc:80"})
    ).spec
    [stopped] = render_stopped_agents(JOB, spec)
    assert stopped["metadata"]["name"] == "agentic-agent-coder"
    assert stopped["spec"]["replicas"] == 0
    assert stopped["spec"]["selector"]["matchLabels"][AGENT_LABEL] == "coder"
