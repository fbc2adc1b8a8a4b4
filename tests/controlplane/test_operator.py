"""The operator against the real control plane: API server, scheduler, garbage
collector, KubeRay and kwok GPU nodes (pools a and b: 2 nodes x 8 GPUs each)."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from rlhf_operator.controller.resizes import STOP_ASKED

from .harness import DEFAULT_NODE_GROUPS, REPO_ROOT, ControlPlane
from .jobs import (
    apply,
    apply_example,
    apply_with_checkpoints,
    get,
    job_status,
    load,
    patch_job,
    recreated,
    status_when,
    worker_pods,
)
from .operator_process import OperatorProcess
from .util import eventually, get_json, kubectl_as

CPU_NODES = next(g for g in DEFAULT_NODE_GROUPS if not g.gpus)


def test_a_head_lost_inside_an_attempt_is_a_driver_restart_in_status_and_an_event(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """The head pod deleted at once (a lost node): KubeRay makes a new one for the same
    Ray cluster, where its submitter starts the driver again. The job says so: its
    status counts the restart (not as a new attempt) and a Warning names both heads. The
    workers of the lost head are replaced."""
    cp = controlplane
    apply_example(cp, namespace, "colocated.yaml")
    name = load(REPO_ROOT / "examples" / "colocated.yaml")["metadata"]["name"]
    first = eventually(lambda: job_status(cp, name, namespace).get("rayHead"), "status.rayHead")
    workers = eventually(lambda: worker_pods(cp, name, namespace), "the worker pods to run")
    joined_first = {p["metadata"]["uid"] for pods in workers.values() for p in pods}
    cp.kubectl("delete", "pod", first, "-n", namespace, "--grace-period=0", "--force")
    status = eventually(lambda: status_when(cp, name, namespace, driverRestarts=1),
                        "status.driverRestarts == 1")  # fmt: skip
    second = status["rayHead"]
    assert second != first and status["restarts"] == 0
    events = eventually(
        lambda: get_json(cp, "events", "-n", namespace, "--field-selector",
                         "reason=DriverRestarted,involvedObject.kind=RLHFJob")["items"],
        "a DriverRestarted event",
    )  # fmt: skip
    assert [(e["type"], e["count"]) for e in events] == [("Warning", 1)]
    assert (
        f"the Ray head {first} of cluster {status['rayCluster']} was lost" in events[0]["message"]
    )
    assert f"KubeRay made {second}" in events[0]["message"]

    # The workers that joined the lost head are replaced by new pods (which wait for the
    # new head) rather than left to crash-loop until it is up.
    def replaced() -> dict[str, list[dict[str, Any]]] | None:
        now = worker_pods(cp, name, namespace)
        uids = {p["metadata"]["uid"] for pods in now.values() for p in pods}
        return now if len(uids) == len(joined_first) and not uids & joined_first else None

    eventually(replaced, "new worker pods in place of those of the lost head")
    cp.kubectl("delete", "rlhfjob", name, "-n", namespace, "--wait=true")


def test_children_deleted_out_of_band_are_recreated(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp = controlplane
    apply_example(cp, namespace, "colocated.yaml")
    first = {kind: eventually(lambda k=kind, n=name: get(cp, k, n, namespace), f"{kind} {name}")
             for kind, name in (("configmap", "colocated-spec"), ("role", "colocated-reporter"), ("rayjob", "colocated"))}  # fmt: skip
    cp.kubectl("delete", "configmap/colocated-spec", "role/colocated-reporter", "-n", namespace)
    cp.kubectl("delete", "rayjob", "colocated", "-n", namespace, "--wait=true")
    for kind, name in (
        ("configmap", "colocated-spec"),
        ("role", "colocated-reporter"),
        ("rayjob", "colocated"),
    ):
        old_uid = first[kind]["metadata"]["uid"]
        again = eventually(
            lambda k=kind, n=name, u=old_uid: recreated(cp, k, n, namespace, u),
            f"{kind} {name} to be recreated",
        )
        assert again["metadata"]["ownerReferences"][0]["name"] == "colocated"
    assert len(get_json(cp, "rayjobs", "-n", namespace)["items"]) == 1


def condition_when(
    cp: ControlPlane, name: str, namespace: str, kind: str, **expected: str
) -> dict[str, Any] | None:
    """The job's condition `kind` once its fields have the given values, else None."""
    conditions = job_status(cp, name, namespace).get("conditions") or []
    found = next((c for c in conditions if c["type"] == kind), None)
    return found if found and all(found.get(k) == v for k, v in expected.items()) else None


def test_an_environment_runs_as_the_jobs_own_service_and_goes_with_it(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp, job, name = controlplane, "agentic-cluster", "agentic-cluster-env-lookup"
    # The one node without the GPU taint, where the environment's pod fits, takes no new
    # pods at first: EnvironmentsReady says the scheduler's reason, then the pod runs.
    cpu_node = CPU_NODES.node_names()[0]
    cp.kubectl("cordon", cpu_node)
    try:
        apply_example(cp, namespace, "agentic-cluster.yaml")
        waiting = eventually(lambda: condition_when(cp, job, namespace, "EnvironmentsReady",
                                                    reason="Unschedulable"),
                             "EnvironmentsReady to say why the pod waits")  # fmt: skip
    finally:
        cp.kubectl("uncordon", cpu_node)
    message = waiting["message"]
    assert waiting["status"] == "False" and message.startswith(
        "0/1 environments have all their replicas ready; environment lookup: "
        f"0 of 1 replicas ready, pod {name}-"
    ), waiting
    assert "Unschedulable: 0/" in message and "node(s) were unschedulable" in message, message
    events = eventually(lambda: [e for e in get_json(cp, "events", "-n", namespace, "--field-selector",
                                                     "reason=Unschedulable")["items"]
                                 if e["message"] == message], "a Warning event saying it")  # fmt: skip
    assert [e["type"] for e in events] == ["Warning"], events
    ready = eventually(lambda: condition_when(cp, job, namespace, "EnvironmentsReady", status="True"),
                       "EnvironmentsReady once the pod runs")  # fmt: skip
    assert ready["message"] == "1/1 environments have all their replicas ready"
    made = {kind: eventually(lambda k=kind: get(cp, k, name, namespace), f"{kind} {name}")
            for kind in ("deployment", "service", "networkpolicy")}  # fmt: skip
    for obj in made.values():
        assert obj["metadata"]["ownerReferences"][0]["name"] == "agentic-cluster"
    pod = made["deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["command"][:4] == ["python", "-m", "rlhf_env", "serve"]
    assert made["service"]["spec"]["clusterIP"] == "None"  # headless: the trainer picks replicas
    policy = made["networkpolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and not policy.get("egress")
    spec = get(cp, "configmap", "agentic-cluster-spec", namespace)
    environments = json.loads((spec or {})["data"]["spec.json"])["environments"]
    assert environments == [{"name": "lookup", "url": f"http://{name}:8000"}]
    # Its pods are what a restricted namespace admits (the server checks, creates nothing).
    template = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "env-check"}, "spec": pod}
    cp.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    cp.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
               input=yaml.safe_dump(template))  # fmt: skip

    # Its replicas may change while the job runs, and nothing else of it.
    patch_job(cp, namespace, job, "json", '[{"op": "add", "path": "/spec/environments/0/replicas", "value": 2}]')  # fmt: skip
    eventually(lambda: (get(cp, "deployment", name, namespace) or {})["spec"]["replicas"] == 2,
               "the environment's Deployment scaled to 2")  # fmt: skip
    refused = patch_job(cp, namespace, job, "json", '[{"op": "replace", "path": "/spec/environments/0/serve", "value": "m:Other"}]', check=False)  # fmt: skip
    assert "only an environment's replicas can change after creation" in refused.stderr

    # Once the job has ended, its environments' pods would only hold resources.
    done = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    cp.kubectl("patch", "rayjob", job, "-n", namespace, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": done}))  # fmt: skip
    eventually(lambda: (get(cp, "deployment", name, namespace) or {})["spec"]["replicas"] == 0,
               "the environment scaled to 0 when the job ended")  # fmt: skip
    # The Deployment is scaled before the status is written: both are waited for.
    eventually(lambda: condition_when(cp, job, namespace, "EnvironmentsReady", reason="EnvironmentsStopped"),
               "EnvironmentsReady to say the environments stopped")  # fmt: skip
    eventually(
        lambda: job_status(cp, job, namespace).get("phase") == "Succeeded", "phase Succeeded"
    )

    cp.kubectl("delete", "rlhfjob", "agentic-cluster", "-n", namespace, "--wait=true")
    for kind in made:
        eventually(lambda k=kind: get(cp, k, name, namespace) is None, f"{kind} {name} to go")


def test_an_agent_runs_as_the_jobs_own_service_owned_and_restricted(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """spec.agents[] (issue 75): the API server admits the job; the operator makes the
    agent's Deployment, Service and NetworkPolicy, owned by the job, and AgentsReady."""
    cp, job, name = controlplane, "agentic-cluster", "agentic-cluster-agent-coder"
    manifest = load(REPO_ROOT / "examples" / "agentic-cluster.yaml")
    spec = manifest["spec"]
    del spec["generation"]["multiTurn"]
    spec["generation"]["agent"] = {"agent": "coder"}
    spec["models"]["reward"] = {"function": "toy_copy"}
    coder = {"name": "coder", "serve": "agents.coder:run", "resources": {"cpu": "200m", "memory": "256Mi"}}  # fmt: skip
    spec |= {"environments": [], "agents": [coder]}
    apply(cp, namespace, manifest)
    ready = eventually(lambda: condition_when(cp, job, namespace, "AgentsReady", status="True"),
                       "AgentsReady once the agent's pod runs")  # fmt: skip
    assert ready["message"] == "1/1 agents have all their replicas ready"
    made = {kind: eventually(lambda k=kind: get(cp, k, name, namespace), f"{kind} {name}")
            for kind in ("deployment", "service", "networkpolicy")}  # fmt: skip
    for obj in made.values():
        assert obj["metadata"]["ownerReferences"][0]["name"] == job
    pod = made["deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["command"][:5] == ["python", "-m", "rlhf_env", "agent", "agents.coder:run"]  # fmt: skip
    gateway = made["networkpolicy"]["spec"]["egress"][0]
    assert gateway["ports"] == [{"protocol": "TCP", "port": 8100}]
    config = json.loads((get(cp, "configmap", f"{job}-spec", namespace) or {})["data"]["spec.json"])
    assert config["agents"] == [{"name": "coder", "url": f"http://{name}:8000", "maxConcurrentEpisodes": 16}]  # fmt: skip
    template = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "agent-check"}, "spec": pod}
    cp.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    cp.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
               input=yaml.safe_dump(template))  # fmt: skip
    refused = patch_job(cp, namespace, job, "json", '[{"op": "add", "path": "/spec/agents/0/replicas", "value": 2}]', check=False)  # fmt: skip
    assert "cannot change after creation" in refused.stderr
    cp.kubectl("delete", "rlhfjob", job, "-n", namespace, "--wait=true")
    for kind in made:
        eventually(lambda k=kind: get(cp, k, name, namespace) is None, f"{kind} {name} to go")


def group_replicas(obj: dict[str, Any] | None) -> dict[str, int]:
    """A RayJob's or RayCluster's worker groups: name -> replicas."""
    spec = (obj or {}).get("spec", {})
    groups = spec.get("rayClusterSpec", spec).get("workerGroupSpecs", [])
    return {g["groupName"]: g["replicas"] for g in groups}


@pytest.mark.slow
def test_resizes_change_the_rollout_pool_in_place_and_the_trainer_pool_by_a_new_attempt(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """The fully-async example (rollout on pool a, trainer on pool b). KubeRay's and the
    trainer's parts in the attempt's end are played by patching statuses, as they would."""
    cp, name = controlplane, "fully-async"
    apply_with_checkpoints(cp, namespace, "fully-async.yaml")

    def running(pools: dict[str, int]) -> dict[str, list[dict[str, Any]]] | None:
        pods = worker_pods(cp, name, namespace)
        return pods if {p: len(pods.get(p, [])) for p in pools} == pools else None

    eventually(lambda: running({"rollout": 1, "trainer": 1}), "a worker in each pool")
    first = eventually(lambda: get(cp, "rayjob", name, namespace), "the RayJob")
    eventually(lambda: ((get(cp, "rayjob", name, namespace) or {}).get("status") or {})
               .get("jobDeploymentStatus") == "Running", "the driver submitted")  # fmt: skip
    cluster = job_status(cp, name, namespace)["rayCluster"]

    # The rollout pool: in place, under the same attempt (its engines join the run).
    patch_job(cp, namespace, name, "json", '[{"op": "replace", "path": "/spec/pools/0/replicas", "value": 2}]')  # fmt: skip
    eventually(lambda: group_replicas(get(cp, "raycluster", cluster, namespace))["rollout"] == 2,
               "the live RayCluster's rollout group to grow")  # fmt: skip
    eventually(lambda: running({"rollout": 2, "trainer": 1}), "a second rollout worker")
    assert get(cp, "rayjob", name, namespace)["metadata"]["uid"] == first["metadata"]["uid"]  # type: ignore[index]
    assert job_status(cp, name, namespace)["phase"] == "Running"

    # Sizes the rules refuse are refused at admission, naming the field: 3 nodes of 8
    # GPUs for the actor do not divide miniBatchSize 64.
    refused = patch_job(cp, namespace, name, "json", '[{"op": "replace", "path": "/spec/pools/1/replicas", "value": 3}]', check=False)  # fmt: skip
    assert refused.returncode != 0 and "spec.trainer.miniBatchSize" in refused.stderr, (
        refused.stderr
    )

    # The trainer pool: Resizing; the running attempt keeps its sizes until its driver stops.
    patch_job(cp, namespace, name, "json", '[{"op": "replace", "path": "/spec/pools/1/replicas", "value": 2}]')  # fmt: skip
    resizing = [{"pool": "trainer", "fromReplicas": 1, "toReplicas": 2}]
    status = eventually(lambda: status_when(cp, name, namespace, phase="Resizing", resizing=resizing),
                        "status Resizing, with the old and new sizes")  # fmt: skip
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert "resizing pool trainer from 1 to 2 nodes" in ready["message"]
    rayjob = get(cp, "rayjob", name, namespace) or {}
    assert rayjob["metadata"]["uid"] == first["metadata"]["uid"]
    assert group_replicas(rayjob)["trainer"] == 1
    # The ask is on the attempt (before the status the trainer reads): its exit 0 is a stop.
    assert rayjob["metadata"]["annotations"][STOP_ASKED] == "trainer: 1 to 2"
    assert len(worker_pods(cp, name, namespace)["trainer"]) == 1
    events = get_json(cp, "events", "-n", namespace, "--field-selector", "reason=Resizing")
    assert [e["type"] for e in events["items"]] == ["Normal"], events

    # The driver checkpoints at step 3, reports it and exits 0 (loop.resize).
    training = {"step": 3, "totalSteps": 1000, "lastCheckpoint": "/checkpoints/step-3"}
    cp.kubectl("patch", "rlhfjob", name, "-n", namespace, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": {"training": training}}))  # fmt: skip
    done = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    cp.kubectl("patch", "rayjob", name, "-n", namespace, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": done}))  # fmt: skip
    second = eventually(lambda: recreated(cp, "rayjob", name, namespace, first["metadata"]["uid"]),
                        "the next attempt's RayJob")  # fmt: skip
    assert group_replicas(second) == {"rollout": 2, "trainer": 2}
    pods = eventually(lambda: running({"rollout": 2, "trainer": 2}), "the new attempt's workers")
    assert len({p["spec"]["nodeName"] for p in pods["trainer"]}) == 2
    status = eventually(lambda: status_when(cp, name, namespace, phase="Running"), "Running again")
    assert status["restarts"] == 0 and "resizing" not in status and "lastFailure" not in status


@pytest.mark.parametrize(("patch", "message"), [
    ('[{"op": "replace", "path": "/spec/pools/0/gpusPerNode", "value": 4}]', "only a pool's replicas can change after creation"),
    ('[{"op": "replace", "path": "/spec/image", "value": "other:1"}]', "spec.image: Invalid value"),
    ('[{"op": "add", "path": "/spec/pools/-", "value": {"name": "extra", "gpusPerNode": 1}}]',
     "pools cannot be added, removed or renamed after creation"),
])  # fmt: skip
def test_changing_fixed_fields_is_rejected_with_a_message(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str, patch: str, message: str
) -> None:
    cp = controlplane
    apply_example(cp, namespace, "colocated.yaml")
    result = patch_job(cp, namespace, "colocated", "json", patch, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


@pytest.mark.slow
def test_suspend_and_resume(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp = controlplane
    apply_example(cp, namespace, "colocated.yaml")
    eventually(lambda: worker_pods(cp, "colocated", namespace).get("all"), "the worker to run")
    patch_job(cp, namespace, "colocated", "merge", '{"spec": {"suspend": true}}')
    eventually(lambda: (get(cp, "rayjob", "colocated", namespace) or {}).get("spec", {}).get("suspend") is True,
               "the RayJob to be suspended")  # fmt: skip
    eventually(
        lambda: status_when(cp, "colocated", namespace, phase="Suspended"), "phase Suspended"
    )
    eventually(lambda: not worker_pods(cp, "colocated", namespace), "the workers to go")
    patch_job(cp, namespace, "colocated", "merge", '{"spec": {"suspend": false}}')
    eventually(
        lambda: worker_pods(cp, "colocated", namespace).get("all"), "the worker to run again"
    )
    eventually(
        lambda: job_status(cp, "colocated", namespace).get("phase") not in (None, "Suspended"),
        "the job to leave Suspended",
    )


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["roles"].update(critic="nowhere"), "spec.roles.critic: Invalid value"),
    (lambda s: s.update({"async": {}}), "fully async needs the rollout on a pool of its own"),
    (lambda s: s["trainer"].update(miniBatchSize=60), "must be a multiple of the actor pool's GPUs"),
    (lambda s: s["pools"][0].update(gpusPerNode=0), "spec.pools[0].gpusPerNode: Invalid value: 0"),
    (lambda s: s["models"].update(reward={"function": "file:score.py:score"}),
     "a file: reward needs the ConfigMap that holds the file"),
])  # fmt: skip
def test_bad_specs_are_refused_at_admission_and_create_nothing(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str, change: Any, message: str
) -> None:
    manifest = load(REPO_ROOT / "examples" / "colocated.yaml")
    change(manifest["spec"])
    result = apply(controlplane, namespace, manifest, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert get(controlplane, "rlhfjob", "colocated", namespace) is None


def test_the_driver_may_report_progress_and_nothing_else_and_the_operator_keeps_it(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp = controlplane
    apply_example(cp, namespace, "colocated.yaml")
    apply_example(cp, namespace, "asymmetric-6-2.yaml")
    eventually(
        lambda: job_status(cp, "colocated", namespace).get("rayJob"), "the operator's first status"
    )
    token = cp.kubectl("create", "token", "colocated-reporter", "-n", namespace).stdout.strip()
    progress = {"step": 3, "totalSteps": 500, "policyVersion": 3}
    patch = json.dumps({"status": {"training": progress}})

    def patch_as_driver(job: str, *where: str) -> subprocess.CompletedProcess[str]:
        return kubectl_as(
            cp, token, "patch", "rlhfjob", job, "-n", namespace, *where, "--type=merge", "-p", patch
        )

    assert patch_as_driver("colocated", "--subresource=status").returncode == 0
    denied_spec = patch_as_driver("colocated")
    denied_other = patch_as_driver("asymmetric-6-2", "--subresource=status")
    assert denied_spec.returncode != 0 and "forbidden" in denied_spec.stderr.lower()
    assert denied_other.returncode != 0 and "forbidden" in denied_other.stderr.lower()

    patch_job(
        cp, namespace, "colocated", "merge", '{"spec": {"suspend": true}}'
    )  # makes the operator write
    eventually(
        lambda: status_when(cp, "colocated", namespace, phase="Suspended"), "phase Suspended"
    )
    assert job_status(cp, "colocated", namespace)["training"] == progress


def test_an_attempt_that_exits_0_with_its_reports_lost_has_succeeded_and_is_not_replaced(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """A job with checkpoints (so a resize could replace it) whose driver ends without
    its reports reaching the status (the last one says step 3 of 500), and no resize
    asked: Succeeded, the same attempt, and a Warning that its progress never came."""
    cp, name = controlplane, "colocated"
    apply_with_checkpoints(cp, namespace, "colocated.yaml")
    attempt = eventually(lambda: get(cp, "rayjob", name, namespace), "the RayJob")
    training = {"step": 3, "totalSteps": 500}
    done = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    for kind, status in (("rlhfjob", {"training": training}), ("rayjob", done)):
        cp.kubectl("patch", kind, name, "-n", namespace, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": status}))  # fmt: skip
    status = eventually(lambda: status_when(cp, name, namespace, phase="Succeeded"), "Succeeded")
    # Decided in the reconcile that wrote Succeeded: a replacement would have said Resizing.
    assert get(cp, "rayjob", name, namespace)["metadata"]["uid"] == attempt["metadata"]["uid"]  # type: ignore[index]
    assert training.items() <= status["training"].items() and "resizing" not in status
    events = get_json(cp, "events", "-n", namespace, "--field-selector", "reason=Succeeded")
    [event] = events["items"]
    assert event["type"] == "Warning", event
    assert "the trainer's last report is step 3 of 500" in event["message"], event


def test_an_invalid_spec_that_slips_past_admission_is_reported_and_not_acted_on(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp = controlplane
    crd_file = REPO_ROOT / "crds" / "rlhfjobs.yaml"
    loose = load(crd_file)  # as if an old CRD without our schema were installed
    loose["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True}  # fmt: skip
    cp.kubectl("replace", "-f", "-", input=yaml.safe_dump(loose))
    try:
        manifest = load(REPO_ROOT / "examples" / "colocated.yaml")
        manifest["spec"]["roles"]["critic"] = "nowhere"
        apply(cp, namespace, manifest)
        status = eventually(
            lambda: status_when(cp, "colocated", namespace, phase="Failed"), "phase Failed"
        )
        invalid = next(c for c in status["conditions"] if c["type"] == "Invalid")
        assert (
            invalid["status"] == "True"
            and "spec.roles.critic: must name a pool" in invalid["message"]
        )
        events = get_json(cp, "events", "-n", namespace, "--field-selector", "reason=InvalidSpec")[
            "items"
        ]
        assert [e["type"] for e in events] == ["Warning"]
        assert "spec.roles.critic" in events[0]["message"]
        for kind, name in (
            ("rayjob", "colocated"),
            ("configmap", "colocated-spec"),
            ("serviceaccount", "colocated-reporter"),
        ):
            assert get(cp, kind, name, namespace) is None, f"{kind} created for an invalid job"
    finally:
        cp.kubectl("replace", "-f", str(crd_file))
        cp.wait_crds_established()  # and the API server's OpenAPI document built again


def test_restart_mid_reconcile_creates_no_duplicates(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    cp, count = controlplane, 6
    base = load(REPO_ROOT / "examples" / "colocated.yaml")
    base["spec"]["pools"][0]["gpusPerNode"] = 1
    base["spec"]["trainer"] = {"batchSize": 8, "miniBatchSize": 8}
    jobs = [{**base, "metadata": {"name": f"burst-{i}"}} for i in range(count)]
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(jobs))
    operator.kill()  # mid-reconcile: some children created, some not, status unwritten
    operator.start()

    def all_reconciled() -> bool:
        return all(job_status(cp, f"burst-{i}", namespace).get("rayJob") for i in range(count))

    eventually(all_reconciled, "every job to be reconciled after the restart")
    eventually(
        lambda: len(get_json(cp, "rayclusters", "-n", namespace)["items"]) == count,
        "a RayCluster per job",
    )
    for kind in ("rayjobs", "configmaps", "serviceaccounts", "roles", "rolebindings"):
        items = get_json(cp, kind, "-n", namespace, "-l", "rlhf.dev/job")["items"]
        assert len(items) == count, f"{kind}: {[i['metadata']['name'] for i in items]}"


def test_a_failed_attempt_restarts_until_max_restarts_then_the_job_fails(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """KubeRay's part, reporting each attempt's failure, is played by patching the
    RayJob's status as KubeRay would. The operator is killed and restarted right after
    the second failure: it must neither count it twice nor start two attempts."""
    cp = controlplane
    manifest = load(REPO_ROOT / "examples" / "colocated.yaml")
    manifest["spec"] |= {
        "checkpointClaim": "checkpoints",
        "restartPolicy": {"maxRestarts": 2, "backoffSeconds": 2},
    }
    apply(cp, namespace, manifest)
    attempts: list[str] = []

    def new_attempt() -> str | None:
        uid = ((get(cp, "rayjob", "colocated", namespace) or {}).get("metadata") or {}).get("uid")
        return uid if uid and uid not in attempts else None

    for number in (1, 2, 3):
        attempts.append(eventually(new_attempt, f"attempt {number}'s RayJob"))
        failure = {"jobDeploymentStatus": "Failed", "reason": "AppFailed",
                   "message": f"attempt {number}: trainer exited with 1"}  # fmt: skip
        cp.kubectl("patch", "rayjob", "colocated", "-n", namespace, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": failure}))  # fmt: skip
        if number == 2:
            eventually(lambda: job_status(cp, "colocated", namespace).get("restarts") == 2,
                       "the second restart counted")  # fmt: skip
            operator.kill()
            operator.start()

    status = eventually(lambda: status_when(cp, "colocated", namespace, phase="Failed"), "Failed")
    assert status["restarts"] == 2
    assert status["lastFailure"]["reason"] == "AppFailed"
    assert status["lastFailure"]["message"] == "attempt 3: trainer exited with 1"
    assert status["lastFailure"]["rayJobUID"] == attempts[-1]
    # No fourth attempt, however late the operator looks: once the backoff is over (by its
    # own record of the failure's time), a spec change makes it reconcile again, which it
    # records in observedGeneration; still no new RayJob.
    backoff = timedelta(seconds=manifest["spec"]["restartPolicy"]["backoffSeconds"])
    backoff_over = datetime.fromisoformat(status["lastFailure"]["time"]) + backoff
    eventually(lambda: datetime.now(UTC) > backoff_over, "the backoff to pass")
    patch_job(cp, namespace, "colocated", "merge", '{"spec": {"suspend": true}}')
    generation = (get(cp, "rlhfjob", "colocated", namespace) or {})["metadata"]["generation"]
    eventually(lambda: status_when(cp, "colocated", namespace, observedGeneration=generation),
               "the operator to reconcile the failed job")  # fmt: skip
    assert new_attempt() is None and job_status(cp, "colocated", namespace)["phase"] == "Failed"
    events = get_json(cp, "events", "-n", namespace, "--field-selector", "reason=Restarting")
    messages = sorted(e["message"] for e in events["items"])
    assert len(messages) == 2, messages
    assert "attempt 1: trainer exited with 1" in messages[0]
    assert "starts from scratch (no checkpoint yet)" in messages[0]


def test_a_pool_the_scheduler_cannot_place_says_why_in_status_and_an_event(
    controlplane: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """A 16-GPU worker for a node group of 8-GPU nodes: the real scheduler leaves it
    pending, and the job says so with the scheduler's own words. (The other pool may be
    waiting too, for nodes that earlier tests' pods still hold: it is listed first.)"""
    cp, manifest = controlplane, load(REPO_ROOT / "examples" / "two-nodes-by-node-8-8.yaml")
    manifest["spec"]["pools"][1]["gpusPerNode"] = 16
    apply(cp, namespace, manifest)
    name, said = manifest["metadata"]["name"], "pool value: 0/16 GPUs, Unschedulable: 0/"

    def value_unschedulable() -> dict[str, Any] | None:
        conditions = job_status(cp, name, namespace).get("conditions", [])
        pools = next((c for c in conditions if c["type"] == "PoolsReady"), {})
        return pools if said in pools.get("message", "") else None

    pools_ready = eventually(value_unschedulable, "PoolsReady to carry the scheduler's reason")
    assert (pools_ready["status"], pools_ready["reason"]) == ("False", "Unschedulable")
    assert "nodes are available" in pools_ready["message"]
    events = eventually(
        lambda: [e for e in get_json(cp, "events", "-n", namespace, "--field-selector", "reason=Unschedulable,involvedObject.kind=RLHFJob")["items"] if said in e["message"]],
        "an Unschedulable event on the job naming the value pool",
    )  # fmt: skip
    assert all(e["type"] == "Warning" for e in events)
