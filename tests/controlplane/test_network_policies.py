"""A job's NetworkPolicy, as the operator renders it with the chart's default values,
enforced on the real node (network_policies.py): the head admits the job's own pods on
every port, Prometheus on the metrics ports and KubeRay on the dashboard port, and
refuses everything else, the job's own environments too (they run the model's tool
calls).

A head stand-in serves the head's three ports; one client pod stands for each kind of
peer. Each client dials each port from inside its pod (kubectl exec). The same dials
before the policy exists, with the enforcer already running, all connect: what is
refused afterwards is refused by the policy.

An environment with egress (issue 72), the policies as the operator renders them without
the chart's peers: refused by the head (dashboard and GCS), by the API server and by the
metadata address, and let through to what it declares. This enforcer judges only what
the node forwards, so every target is a pod: the API server stands behind a ClusterIP
Service (the enforcer judges its endpoint's address, after kube-proxy's translation),
and the metadata address and the internet are pods whose addresses the rendering is
given as such (`NetworkAccess(cluster_ranges=..., metadata=...)`), the cluster's ranges
being the Service range and the other pods' addresses.

An agent (issue 75), the policies as the operator renders them with the chart's peers
(the job's own, the agent's and the gateway's), its pods' and the Ray pods' labels taken
from the rendered Deployment and RayJob: the agent reaches the rollout worker's gateway
port and is refused by the head and the API server; the gateway's port refuses another
job's agent and an outsider."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import yaml

from rlhf_operator.api.agents import service_name
from rlhf_operator.api.validation import parse_job
from rlhf_operator.render.children import HEAD_PORTS as RAY_HEAD_PORTS
from rlhf_operator.render.children import TRAINER_METRICS_PORT, render_children
from rlhf_operator.render.environments import ENVIRONMENT_LABEL
from rlhf_operator.render.meta import JOB_POD_COMPONENTS, JobRef, labels, metadata, pods_of
from rlhf_operator.render.network import (
    RAY_DASHBOARD_PORT,
    RAY_METRICS_PORT,
    NetworkAccess,
    Peers,
    render_network_policy,
)
from rlhf_trainer.api.agents import GATEWAY_PORT

from .harness import REPO_ROOT, SERVICE_CIDR, ControlPlane
from .network_policies import (
    Proof,
    dialled_across,
    dials,
    enforcer_log,
    network_policies_enforced,
)
from .node import NETTOOL_IMAGE, RealNode
from .scan_manifests import chart_network_access
from .test_node import nettool_pod, wait_ready
from .util import eventually, get_json

pytestmark = pytest.mark.slow  # the enforcer, about eight pods, dozens of dials: ~1 min each

HEAD_PORTS = (RAY_DASHBOARD_PORT, RAY_METRICS_PORT, TRAINER_METRICS_PORT)
IDLE_PORT = 9999  # what the clients serve, only to keep running


def clients(job: JobRef) -> dict[str, dict[str, str]]:
    """Each client pod's name and labels."""
    return {
        "worker": labels(job, "worker"),
        "submitter": labels(job, "submitter"),
        "environment": labels(job, "environment"),  # the job's, but not a Ray pod
        "prometheus": {"app.kubernetes.io/name": "prometheus"},
        "kuberay-helm": {"app.kubernetes.io/name": "kuberay-operator"},  # KubeRay's Helm chart's
        "kuberay": {"app.kubernetes.io/name": "kuberay"},  # KubeRay's kustomize manifests'
        "outsider": {"app": "outsider"},
    }


def head_pod(job: JobRef, ports: tuple[int, ...] = HEAD_PORTS) -> dict[str, Any]:
    return server_pod("head", labels(job, "head"), ports)


def server_pod(name: str, pod_labels: dict[str, str], ports: tuple[int, ...]) -> dict[str, Any]:
    """A pod serving each of `ports`, Ready once it does."""
    pod = nettool_pod(name, [])
    pod["metadata"]["labels"] = pod_labels
    probe = {"periodSeconds": 1}  # the kubelet's probes come from the node: never queued
    pod["spec"]["containers"] = [
        {"name": f"port-{port}", "image": NETTOOL_IMAGE, "imagePullPolicy": "Never",
         "args": ["serve", str(port)], "readinessProbe": {"tcpSocket": {"port": port}, **probe}}
        for port in ports
    ]  # fmt: skip
    return pod


def client_pod(name: str, pod_labels: dict[str, str]) -> dict[str, Any]:
    pod = nettool_pod(name, ["serve", str(IDLE_PORT)])
    pod["metadata"]["labels"] = pod_labels
    return pod


@contextmanager
def nettool_namespace(cp: ControlPlane, real_node: RealNode, prefix: str) -> Iterator[str]:
    """A namespace of its own for a proof's pods (nettool's image on the node), deleted
    with them at the end."""
    real_node.import_go_image("nettool", NETTOOL_IMAGE)
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cp.create_namespace(namespace)
    try:
        yield namespace
    finally:
        cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def reaches(cp: ControlPlane, namespace: str, client: str, ip: str) -> dict[int, bool]:
    """Which of the head's ports `client` connects to."""
    found = dials(cp, namespace, client, [f"{ip}:{port}" for port in HEAD_PORTS])
    return {port: found[f"{ip}:{port}"] for port in HEAD_PORTS}


def reachability(cp: ControlPlane, namespace: str, names: list[str], ip: str) -> dict[str, Any]:
    with ThreadPoolExecutor(len(names)) as pool:
        found = pool.map(lambda name: reaches(cp, namespace, name, ip), names)
        return dict(zip(names, found, strict=True))


def test_a_jobs_policy_admits_its_pods_prometheus_and_kuberay_and_refuses_the_rest(
    controlplane: ControlPlane, real_node: RealNode
) -> None:
    cp = controlplane
    with nettool_namespace(cp, real_node, "t-netpol") as namespace:
        job = JobRef(name="netpol", namespace=namespace, uid=str(uuid.uuid4()))
        peers = clients(job)
        pods = [head_pod(job), *(client_pod(name, peer) for name, peer in peers.items())]
        cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(pods))
        head_ip = wait_ready(cp, namespace, "head")["status"]["podIP"]
        for name in peers:
            wait_ready(cp, namespace, name)
        with network_policies_enforced(cp) as enforcer:
            before = reachability(cp, namespace, list(peers), head_ip)
            meta = metadata(job, job.name, "network")
            meta.pop("ownerReferences")  # there is no RLHFJob here to own it
            chart_peers = Peers(**chart_network_access())
            job_pods = pods_of(job, JOB_POD_COMPONENTS)
            policy = render_network_policy(meta, job_pods, chart_peers, TRAINER_METRICS_PORT)
            cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(policy))
            # The enforcer writes its rules as the policy arrives: until the outsider is
            # refused at one port, the others' results would be the old rules'.
            eventually(
                lambda: not reaches(cp, namespace, "outsider", head_ip)[RAY_DASHBOARD_PORT],
                "the outsider refused once the policy is in place",
            )
            after = reachability(cp, namespace, list(peers), head_ip)
            log = enforcer_log(cp, enforcer)

    assert enforcer["spec"]["nodeName"] == real_node.name
    # The refusals are its verdicts, not a network fault.
    assert 'verdict="drop"' in log and 'verdict="accept"' in log, log[-3000:]
    everything = dict.fromkeys(HEAD_PORTS, True)
    assert before == dict.fromkeys(peers, everything), before
    nothing = dict.fromkeys(HEAD_PORTS, False)
    metrics = {RAY_DASHBOARD_PORT: False, RAY_METRICS_PORT: True, TRAINER_METRICS_PORT: True}
    dashboard = {RAY_DASHBOARD_PORT: True, RAY_METRICS_PORT: False, TRAINER_METRICS_PORT: False}
    assert after == {
        "worker": everything,
        "submitter": everything,
        "environment": nothing,
        "prometheus": metrics,
        "kuberay-helm": dashboard,
        "kuberay": dashboard,
        "outsider": nothing,
    }, after


GCS_PORT = RAY_HEAD_PORTS["gcs-server"]
API_PORT, API_SERVICE_PORT = 6443, 443  # as the kubernetes Service and its endpoints
METADATA_PORT = 8081  # the metadata service's 80, unprivileged
DECLARED_PORT, UNDECLARED_PORT = 5432, 2222  # a database the environment may use
INTERNET_PORT = 8443


# A proof's servers: each one's labels and the ports it serves, by name.
Servers = dict[str, tuple[dict[str, str], tuple[int, ...]]]


def serve(
    cp: ControlPlane,
    namespace: str,
    head_labels: dict[str, str],
    servers: Servers,
    clients: dict[str, dict[str, str]],
) -> tuple[dict[str, str], dict[str, str]]:
    """A proof's pods: a head (dashboard and GCS) with `head_labels`, an API server behind
    the Service `api` as the kubernetes Service is, `servers`, and `clients` (labels by
    name). Every pod's IP once Ready, and the targets (HOST:PORT) that both proofs dial:
    the head's two ports and the API server through its Service (the enforcer judges its
    endpoint's address, after kube-proxy's translation)."""
    every: Servers = {
        "head": (head_labels, (RAY_DASHBOARD_PORT, GCS_PORT)),
        "api": ({"app": "api"}, (API_PORT,)),
        **servers,
    }
    api_service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "api"},
        "spec": {"selector": {"app": "api"},
                 "ports": [{"port": API_SERVICE_PORT, "targetPort": API_PORT}]},
    }  # fmt: skip
    objects = [*(server_pod(name, pod_labels, ports) for name, (pod_labels, ports) in every.items()),
               *(client_pod(name, pod_labels) for name, pod_labels in clients.items()), api_service]  # fmt: skip
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))
    ips = {name: wait_ready(cp, namespace, name)["status"]["podIP"] for name in [*every, *clients]}
    api = get_json(cp, "service", "-n", namespace, "api")["spec"]["clusterIP"]
    return ips, {
        "head-dashboard": f"{ips['head']}:{RAY_DASHBOARD_PORT}",
        "head-gcs": f"{ips['head']}:{GCS_PORT}",
        "api-server": f"{api}:{API_SERVICE_PORT}",
    }


def egress_policies(job: JobRef, declared_ip: str, network: NetworkAccess) -> list[dict[str, Any]]:
    """The NetworkPolicies of the agentic example as the operator renders them without
    the chart's peers, its environment given egress: true and one declared address."""
    manifest = yaml.safe_load((REPO_ROOT / "examples" / "agentic-cluster.yaml").read_text())
    manifest["metadata"]["name"] = job.name
    declared = {"cidr": f"{declared_ip}/32", "ports": [DECLARED_PORT]}
    manifest["spec"]["environments"][0] |= {"egress": True, "egressTo": [declared]}
    objects = render_children(job, parse_job(manifest).spec, network)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        policy["metadata"].pop("ownerReferences")  # there is no RLHFJob here to own them
    return policies


def test_an_environment_with_egress_is_refused_by_the_head_the_api_server_and_the_metadata(
    controlplane: ControlPlane, real_node: RealNode
) -> None:
    cp = controlplane
    with nettool_namespace(cp, real_node, "t-egress") as namespace:
        job = JobRef(name="egress", namespace=namespace, uid=str(uuid.uuid4()))
        other_job = JobRef(name="other", namespace=namespace, uid=str(uuid.uuid4()))
        servers: Servers = {
            "metadata": ({"app": "metadata"}, (METADATA_PORT,)),
            "database": ({"app": "database"}, (DECLARED_PORT, UNDECLARED_PORT)),
            "internet": ({"app": "internet"}, (INTERNET_PORT,)),
        }
        clients = {
            "environment": {**labels(job, "environment"), ENVIRONMENT_LABEL: "lookup"},
            # Another job's environment, whose own policy gives it no egress to refuse it:
            # only the head's policy stands in its way.
            "other-environment": {**labels(other_job, "environment"), ENVIRONMENT_LABEL: "calc"},
            "outsider": {"app": "outsider"},
        }
        ips, head_and_api = serve(cp, namespace, labels(job, "head"), servers, clients)
        targets = {
            **head_and_api,
            "metadata": f"{ips['metadata']}:{METADATA_PORT}",
            "declared": f"{ips['database']}:{DECLARED_PORT}",
            "undeclared-port": f"{ips['database']}:{UNDECLARED_PORT}",
            "internet": f"{ips['internet']}:{INTERNET_PORT}",
        }
        # Here the cluster is the Service range and these pods (the database too: an
        # in-cluster one, allowed by its declaration alone); the metadata address and
        # the internet are the two pods left out.
        cluster_pods = [name for name in ips if name not in ("metadata", "internet")]
        network = NetworkAccess(
            cluster_ranges=(SERVICE_CIDR, *(f"{ips[name]}/32" for name in cluster_pods)),
            metadata=(f"{ips['metadata']}/32",),
        )
        policies = egress_policies(job, ips["database"], network)
        # The environment dials every target; the others, the head.
        proof = Proof(namespace, "environment", targets, ("outsider", "other-environment"),
                      guarded=targets["head-dashboard"])  # fmt: skip
        # The enforcer writes its rules as the policies arrive: both in place first.
        enforced = dialled_across(cp, proof, policies,
                                  lambda now: not now[0]["metadata"] and not now[1]["other-environment"],
                                  "the environments refused once the policies are in place")  # fmt: skip
    before, after, enforcer, log = enforced.before, enforced.after, enforced.enforcer, enforced.log

    assert sorted(p["metadata"]["name"] for p in policies) == ["egress", "egress-env-lookup"]
    assert enforcer["spec"]["nodeName"] == real_node.name
    assert 'verdict="drop"' in log and 'verdict="accept"' in log, log[-3000:]
    assert before == (dict.fromkeys(targets, True), {"outsider": True, "other-environment": True})
    assert after == (
        {
            "head-dashboard": False,  # the Ray head: its job API runs any code
            "head-gcs": False,
            "api-server": False,  # through its Service, judged at its endpoint's address
            "metadata": False,
            "declared": True,  # egressTo, on its port only
            "undeclared-port": False,
            "internet": True,  # egress: true
        },
        # The head's policy refuses environments' pods, of any job, and admits the rest.
        {"outsider": True, "other-environment": False},
    ), after


GATEWAY = "examples/agents/letters-cluster.yaml"  # an agent job, rendered by the operator


def agent_job_objects(job: JobRef, network: NetworkAccess) -> dict[str, dict[str, Any]]:
    """The agent example's objects as the operator renders them with the chart's peers
    (so the job has its own policy and the gateway's), by kind and name."""
    manifest = yaml.safe_load((REPO_ROOT / GATEWAY).read_text())
    manifest["metadata"]["name"] = job.name
    objects = render_children(job, parse_job(manifest).spec, network)
    for obj in objects:
        obj["metadata"].pop("ownerReferences", None)  # no RLHFJob here to own them
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


def ray_pod_labels(rayjob: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The head's and the (one) worker group's pod labels, as the RayJob gives them."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    head = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    return head, workers["template"]["metadata"]["labels"]


def test_an_agent_reaches_the_gateway_only_and_only_the_jobs_agents_reach_it(
    controlplane: ControlPlane, real_node: RealNode
) -> None:
    """The agent pod, its policy and the gateway's as rendered: it reaches the rollout
    worker's gateway port and is refused by the head (dashboard and GCS) and the API
    server; another job's agent and an outsider are refused by the gateway port."""
    cp = controlplane
    with nettool_namespace(cp, real_node, "t-agent") as namespace:
        job = JobRef(name="gw", namespace=namespace, uid=str(uuid.uuid4()))
        other_job = JobRef(name="other", namespace=namespace, uid=str(uuid.uuid4()))
        network = NetworkAccess(peers=Peers(**chart_network_access()))
        rendered = agent_job_objects(job, network)
        deployment = rendered[f"Deployment/{service_name(job.name, 'letters')}"]
        agent_labels = deployment["spec"]["template"]["metadata"]["labels"]
        other_agent = agent_job_objects(other_job, network)[
            f"Deployment/{service_name(other_job.name, 'letters')}"
        ]["spec"]["template"]["metadata"]["labels"]
        head_labels, rollout_labels = ray_pod_labels(rendered[f"RayJob/{job.name}"])
        policies = [o for o in rendered.values() if o["kind"] == "NetworkPolicy"]
        servers: Servers = {"rollout": (rollout_labels, (GATEWAY_PORT,))}
        clients = {
            "agent": agent_labels,
            "other-agent": other_agent,
            "outsider": {"app": "outsider"},
        }
        ips, head_and_api = serve(cp, namespace, head_labels, servers, clients)
        targets = {"gateway": f"{ips['rollout']}:{GATEWAY_PORT}", **head_and_api}
        # The agent dials every target; every client, the gateway.
        proof = Proof(namespace, "agent", targets, tuple(clients), guarded=targets["gateway"])
        # The enforcer writes its rules as the policies arrive: each side in place first.
        enforced = dialled_across(cp, proof, policies,
                                  lambda now: not now[0]["api-server"] and not now[1]["outsider"],
                                  "the agent and the outsider refused once the policies are in place")  # fmt: skip
    before, after, enforcer, log = enforced.before, enforced.after, enforced.enforcer, enforced.log

    assert sorted(p["metadata"]["name"] for p in policies) == [
        "gw", "gw-agent-letters", "gw-gateway"
    ]  # fmt: skip
    assert enforcer["spec"]["nodeName"] == real_node.name
    assert 'verdict="drop"' in log and 'verdict="accept"' in log, log[-3000:]
    assert before == (dict.fromkeys(targets, True), dict.fromkeys(clients, True)), before
    assert after == (
        {
            "gateway": True,  # the rollout pool's gateway: what the agent is for
            "head-dashboard": False,  # the Ray head: its job API runs any code
            "head-gcs": False,
            "api-server": False,  # through its Service, judged at its endpoint's address
        },
        # Only the job's own agents reach the gateway's port.
        {"agent": True, "other-agent": False, "outsider": False},
    ), after
