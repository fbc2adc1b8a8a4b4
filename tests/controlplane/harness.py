"""A real Kubernetes control plane on loopback, for tests and for people to poke at.

Every component is the upstream program, built from the pinned Go modules under
``go/`` (``make -f tests/controlplane/controlplane.mk controlplane``):

    etcd -> kube-apiserver -> kube-controller-manager, kube-scheduler, kwok
                           -> KubeRay CRDs + our CRDs (crds/) -> KubeRay operator
                           -> fake nodes (managed by kwok)
                           -> Kueue's manager, on request (start_kueue)
                           -> a real node where it can run (node.py), beside kwok's

Nothing is faked except the machines: kwok plays the kubelets of fake nodes, so
pods are really scheduled by kube-scheduler and marked Running by kwok. The real node
(kubelet, kube-proxy, containerd, CoreDNS) really runs the pods sent to it; with it, the
API server listens on the node's private address instead of loopback, so pods reach it.

Needs only the standard library, PyYAML, the ``kubernetes`` client and the
``openssl`` command (certificates are made on the fly, per run).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from .pki import kubeconfig_yaml, leaf_certificate, make_pki
from .processes import Process, free_ports, tail

if TYPE_CHECKING:
    from .node import RealNode

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
BIN_DIR = HERE / "bin"
RUN_ROOT = HERE / ".run"
GO_DIR = HERE / "go"
MAKEFILE = HERE / "controlplane.mk"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
    "kuberay-operator",
    "kueue-manager",
    "kube-score",
)

GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# kwok's stock stages (what `kwokctl` uses): nodes become Ready and keep a lease,
# pods go Pending -> Running (init containers included) -> deleted when asked.
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/general/pod-create.yaml",
    "kustomize/stage/pod/general/pod-init-container-running.yaml",
    "kustomize/stage/pod/general/pod-init-container-completed.yaml",
    "kustomize/stage/pod/general/pod-ready.yaml",
    "kustomize/stage/pod/general/pod-complete.yaml",
    "kustomize/stage/pod/general/pod-delete.yaml",
)


class ControlPlaneError(RuntimeError):
    pass


@dataclass(frozen=True)
class NodeGroup:
    """Fake nodes sharing a ``pool=<pool>`` label; GPU nodes carry the GPU taint."""

    pool: str
    count: int
    gpus: int = 0
    cpu: str = "32"
    memory: str = "256Gi"
    # As a kubelet reports its disk: a pod that requests some (an environment's) fits.
    ephemeral_storage: str = "200Gi"

    def node_names(self) -> list[str]:
        return [f"kwok-{self.pool}-{i}" for i in range(self.count)]


DEFAULT_NODE_GROUPS = (
    NodeGroup("a", count=2, gpus=8),
    NodeGroup("b", count=2, gpus=8),
    NodeGroup("cpu", count=1),
)


# --------------------------------------------------------------------------- binaries


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if not (BIN_DIR / b).is_file()]


def build_binaries(log_path: Path | None = None) -> None:
    """Run the Makefile fragment: a no-op when binaries are newer than go.mod/go.sum."""
    cmd = [
        "make",
        "--no-print-directory",
        "-f",
        str(MAKEFILE.relative_to(REPO_ROOT)),
        "controlplane",
    ]
    with open(log_path or os.devnull, "ab") as out:
        rc = subprocess.call(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        where = f"; see {log_path}" if log_path else ""
        raise ControlPlaneError(f"{' '.join(cmd)} failed with exit code {rc}{where}")


def go_module_dir(module_dir: Path, module: str) -> Path:
    """Where `module` (as pinned by the go.mod in module_dir) lies in the module cache."""
    out = subprocess.run(
        ["go", "list", "-m", "-json", module],
        cwd=module_dir,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    info = json.loads(out)
    if not info.get("Dir"):  # not downloaded yet (e.g. binaries were copied in)
        subprocess.run(["go", "mod", "download", module], cwd=module_dir, check=True)
        return go_module_dir(module_dir, module)
    return Path(info["Dir"])


def kuberay_crd_dir() -> Path:
    root = go_module_dir(GO_DIR / "kuberay", "github.com/ray-project/kuberay/ray-operator")
    return root / "config" / "crd" / "bases"


def kuberay_crd_files() -> list[Path]:
    """The CRDs of the kinds the operator serves. RayCronJob is left out: its
    controller is off by default (feature gate) and its 0.7 MB schema slows start-up."""
    return [
        kuberay_crd_dir() / f"ray.io_{plural}.yaml"
        for plural in ("rayclusters", "rayjobs", "rayservices")
    ]


def monitoring_crd_files() -> list[Path]:
    """The Prometheus Operator's ServiceMonitor and PodMonitor CRDs, which the chart's
    optional monitors need (pinned in go/monitoring)."""
    root = go_module_dir(
        GO_DIR / "monitoring", "github.com/prometheus-operator/prometheus-operator"
    )
    crds = root / "example" / "prometheus-operator-crd"
    return [
        crds / f"monitoring.coreos.com_{plural}.yaml"
        for plural in ("servicemonitors", "podmonitors")
    ]


def kueue_crd_files() -> list[Path]:
    root = go_module_dir(GO_DIR / "kueue", "sigs.k8s.io/kueue")
    return sorted((root / "config" / "components" / "crd" / "bases").glob("*.yaml"))


def can_run_kueue() -> bool:
    """Kueue's manager reads its metrics certificate from a fixed path under /etc, which
    start_kueue bind-mounts in a mount namespace of its own: that needs root."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def kueue_config(namespace: str, ports: dict[str, int], cert_dir: Path) -> dict:
    """Kueue's configuration: only RayJobs carrying a queue label are its business; no
    leader election, and no visibility server (it would take a fixed port)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": namespace,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['metrics']}"},
        # Served, but no webhook configuration points at it: the operator creates queued
        # RayJobs suspended itself, which is what Kueue's defaulting webhook would do.
        "webhook": {"host": "127.0.0.1", "port": ports["webhook"], "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "featureGates": {"VisibilityOnDemand": False},
        "integrations": {"frameworks": ["ray.io/rayjob"]},
    }


def kwok_stage_files() -> list[Path]:
    root = go_module_dir(GO_DIR / "tools", "sigs.k8s.io/kwok")
    return [root / stage for stage in KWOK_STAGES]


# --------------------------------------------------------------------------- helpers


def _has_condition(obj: dict, condition: str) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == condition and c["status"] == "True" for c in conditions)


def _https_get(url: str, context: ssl.SSLContext) -> int:
    with urllib.request.urlopen(url, context=context, timeout=2) as resp:
        return resp.status


def _http_get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status


def _new_run_dir() -> Path:
    """RUN_ROOT/<date>-<time>-<pid>-<random>: sortable, unique, and its owner known."""
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    prefix = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=RUN_ROOT))


def _run_owner_alive(run_dir: Path) -> bool:
    try:
        pid = int(run_dir.name.split("-")[2])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# --------------------------------------------------------------------------- nodes


def node_manifests(groups: Sequence[NodeGroup]) -> list[dict]:
    nodes = []
    for group in groups:
        resources = {
            "cpu": group.cpu,
            "memory": group.memory,
            "ephemeral-storage": group.ephemeral_storage,
            "pods": "110",
        }
        if group.gpus:
            resources[GPU_RESOURCE] = str(group.gpus)
        for name in group.node_names():
            nodes.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        # kwok manages only nodes carrying this annotation.
                        "annotations": {
                            KWOK_NODE_ANNOTATION: "fake",
                            "node.alpha.kubernetes.io/ttl": "0",
                        },
                        "labels": {
                            "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "type": "kwok",
                            "pool": group.pool,
                        },
                    },
                    "spec": {"taints": [GPU_TAINT] if group.gpus else []},
                    "status": {"capacity": resources, "allocatable": resources},
                }
            )
    return nodes


# --------------------------------------------------------------------------- control plane


class ControlPlane:
    """Start with ``start()`` (or ``with ControlPlane() as cp:``), stop with ``stop()``."""

    def __init__(
        self,
        run_dir: Path | None = None,
        node_groups: Sequence[NodeGroup] = DEFAULT_NODE_GROUPS,
        crd_dirs: Sequence[Path] = (REPO_ROOT / "crds",),
        keep_runs: int = 5,
    ):
        self.run_dir = Path(run_dir) if run_dir else _new_run_dir()
        self.node_groups = tuple(node_groups)
        self.crd_dirs = tuple(Path(d) for d in crd_dirs)
        self.keep_runs = keep_runs
        self.pki = self.run_dir / "pki"
        self.logs_dir = self.run_dir / "logs"
        self.kubeconfig = self.run_dir / "kubeconfig"
        self.ca_file = self.pki / "ca.crt"  # the cluster CA, for clients that use tokens
        self.server = ""  # https://<api_host>:<port>, known once started
        # Loopback, or the real node's address (pods cannot reach loopback).
        self.api_host = "127.0.0.1"
        self.real_node: RealNode | None = None  # None where it cannot run (see below)
        self.real_node_absent = ""  # why there is no real node
        self.processes: list[Process] = []
        self.phase_seconds: dict[str, float] = {}
        self.startup_seconds: float | None = None
        self.crd_errors: dict[str, str] = {}  # file name in crds/ -> the API server's refusal
        self._ports: dict[str, int] = {}

    # ----- lifecycle

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        if missing_binaries():
            raise ControlPlaneError(
                f"missing {missing_binaries()} in {BIN_DIR}: run `make -f {MAKEFILE.relative_to(REPO_ROOT)} controlplane`"
            )
        self._prune_old_runs()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        began = time.monotonic()
        try:
            self._phase("real node host", self._start_real_node_host)
            self._phase("certificates", self._prepare)
            self._phase("etcd", self._start_etcd)
            self._phase("kube-apiserver", self._start_apiserver)
            self._phase("controllers", self._start_controllers)
            self._phase("real node agents", self._start_real_node_agents)
            self._phase("create crds", self._create_crds)
            self._phase("nodes", self._create_nodes)
            # KubeRay's operator exits if its kinds are not served yet.
            self._phase("crds established", self.wait_crds_established)
            self._phase("kuberay-operator", self._start_kuberay)
            self._phase("ready", self._wait_ready)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        # The real node's agents first (clients of the API server), its address last: the
        # API server takes 10 s to stop once the address it listens on is gone.
        if self.real_node:
            self.real_node.stop_agents()
        # Reverse order: clients first, etcd last, so shutdown is quiet and quick.
        while self.processes:
            self.processes.pop().stop()
        if self.real_node:
            self.real_node.stop()
        shutil.rmtree(self.run_dir / "etcd-data", ignore_errors=True)
        atexit.unregister(self.stop)

    def _phase(self, name: str, fn: Callable[[], None]) -> None:
        began = time.monotonic()
        fn()
        self.phase_seconds[name] = round(time.monotonic() - began, 2)

    def _prune_old_runs(self) -> None:
        """Keep the newest runs' logs; never touch a run whose process still lives."""
        runs = sorted(p for p in RUN_ROOT.iterdir() if p.is_dir() and p != self.run_dir)
        finished = [p for p in runs if not _run_owner_alive(p)]
        for old in finished[: max(0, len(finished) - self.keep_runs + 1)]:
            shutil.rmtree(old, ignore_errors=True)

    # ----- components

    def _spawn(self, name: str, argv: Sequence[str], env: dict | None = None) -> Process:
        proc = Process(name, argv, self.logs_dir / f"{name}.log", env)
        proc.start()
        self.processes.append(proc)
        return proc

    def _start_real_node_host(self) -> None:
        """The real node's host side (network, containerd), before the API server binds
        its address. Where it cannot start, the control plane runs without it."""
        from .node import start_real_node

        node_dir = self.run_dir / "node"
        self.real_node, self.real_node_absent = start_real_node(node_dir, self.logs_dir, self.pki)
        if self.real_node:
            self.api_host = self.real_node.node_ip

    def _start_real_node_agents(self) -> None:
        if self.real_node:
            self.real_node.start_agents(self.kubeconfig)

    def _prepare(self) -> None:
        """Certificates, ports and the kubeconfig: everything known before any start."""
        make_pki(self.pki, [self.api_host])
        names = [
            "etcd",
            "etcd-peer",
            "apiserver",
            "kcm",
            "scheduler",
            "kwok",
        ]
        self._ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.server = f"https://{self.api_host}:{self._ports['apiserver']}"
        self.kubeconfig.write_text(kubeconfig_yaml(self.server, self.pki))
        self._client_tls = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        self._client_tls.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self._ports['etcd']}"
        peer = f"http://127.0.0.1:{self._ports['etcd-peer']}"
        proc = self._spawn(
            "etcd",
            [
                BIN_DIR / "etcd",
                "--name",
                "default",
                "--data-dir",
                self.run_dir / "etcd-data",
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
                # Test data need not survive a power cut; fsync dominates etcd latency here.
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        self._wait("etcd", lambda: _http_get(f"{client}/health") == 200, proc, timeout=30)

    def _start_apiserver(self) -> None:
        pki = self.pki
        proc = self._spawn(
            "kube-apiserver",
            [
                BIN_DIR / "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{self._ports['etcd']}",
                f"--bind-address={self.api_host}",
                f"--advertise-address={self.api_host}",
                f"--secure-port={self._ports['apiserver']}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                # As kubeadm does; without it the controller manager and scheduler log an
                # error every second about the missing request-header CA. No client cert
                # here has the allowed name, so no one can use the headers.
                f"--requestheader-client-ca-file={pki / 'ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                "--authorization-mode=RBAC",
                # As OpenShift does: setting blockOwnerDeletion on a child needs update
                # on its owner's finalizers, which the chart's RBAC must then grant.
                # PodNodeSelector and PodTolerationRestriction: a namespace may send all
                # its pods to the real node (demo.py), as a platform sends a team's pods
                # to its node group.
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement,"
                "PodNodeSelector,PodTolerationRestriction",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Endpoints may not point at loopback, and no pod could reach it anyway;
                # with the real node, the `kubernetes` Service leads to its address.
                f"--endpoint-reconciler-type={'lease' if self.real_node else 'none'}",
                # Logs and exec reach a kubelet as admin, at its node's address (a real
                # node's hostname resolves nowhere).
                f"--kubelet-client-certificate={pki / 'admin.crt'}",
                f"--kubelet-client-key={pki / 'admin.key'}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--allow-privileged=true",
                "--profiling=false",
                f"--cert-dir={self.run_dir / 'apiserver-certs'}",
            ],
        )
        self._wait_apiserver(proc)

    def _wait_apiserver(self, proc: Process) -> None:
        ready = f"{self.server}/readyz"
        # A bound, not a pace: a restarted API server refills every watch cache from etcd
        # before it is ready, which once took over 60 s on a loaded machine.
        self._wait("kube-apiserver", lambda: _https_get(ready, self._client_tls) == 200, proc, 180)

    @contextlib.contextmanager
    def api_server_stopped(self) -> Iterator[None]:
        """The API server stopped for the body (etcd and every other component keep
        running, unable to reach it), then started again with the same port, data and
        certificates. Returns once its clients are back: every node (kwok's and the real
        one's kubelet) has renewed its lease through it, so later tests find nodes Ready."""
        proc = next(p for p in self.processes if p.name == "kube-apiserver")
        # Its port closes at once on SIGTERM, but the process lingers 10 s or more: kill it.
        proc.stop(grace=1)
        try:
            yield
        finally:
            restarted = datetime.now(UTC)
            proc.start()
            self._wait_apiserver(proc)
            nodes = [n for g in self.node_groups for n in g.node_names()]
            nodes += [self.real_node.name] if self.real_node else []
            self._wait("every node's lease renewed", lambda: self._leases_renewed(nodes, restarted),
                       None, timeout=90)  # fmt: skip

    @contextlib.contextmanager
    def host_kuberay_stopped(self) -> Iterator[None]:
        """KubeRay's process on this machine stopped for the body (a KubeRay inside the
        cluster takes the RayJobs meanwhile: two would reconcile the same ones), then
        started again (on new ports); returns once it is ready."""
        proc = next(p for p in self.processes if p.name == "kuberay-operator")
        proc.stop()
        self.processes.remove(proc)
        try:
            yield
        finally:
            self._start_kuberay()

    def _leases_renewed(self, nodes: list[str], since: datetime) -> bool:
        """Whether each node's Lease was renewed after `since`."""
        out = self.kubectl("get", "leases", "-n", "kube-node-lease", "-o", "json", check=False)
        if out.returncode != 0:
            return False
        renewed = {
            lease["metadata"]["name"]: datetime.fromisoformat(lease["spec"]["renewTime"])
            for lease in json.loads(out.stdout)["items"]
            if lease["spec"].get("renewTime")
        }
        return all(node in renewed and renewed[node] > since for node in nodes)

    def _start_controllers(self) -> None:
        """Start kube-controller-manager, kube-scheduler and kwok together; their
        health is checked later, in _wait_ready, while the CRDs install."""
        kc = self.kubeconfig
        delegated = [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
        ]
        self._spawn(
            "kube-controller-manager",
            [
                BIN_DIR / "kube-controller-manager",
                *delegated,
                f"--secure-port={self._ports['kcm']}",
                f"--cert-dir={self.run_dir / 'kcm-certs'}",
                # Signs service-account tokens (token controller) and publishes the root CA.
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={self.pki / 'ca.crt'}",
                f"--cluster-signing-key-file={self.pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                BIN_DIR / "kube-scheduler",
                *delegated,
                f"--secure-port={self._ports['scheduler']}",
                f"--cert-dir={self.run_dir / 'scheduler-certs'}",
            ],
        )
        self._spawn(
            "kwok",
            [
                BIN_DIR / "kwok",
                f"--kubeconfig={kc}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--server-address=127.0.0.1:{self._ports['kwok']}",
                # The API server reaches "kubelets" (logs, exec) at the node's IP and port:
                # point that at kwok itself, on loopback.
                "--node-ip=127.0.0.1",
                f"--node-port={self._ports['kwok']}",
                "--cidr=10.244.0.1/16",
                "--node-lease-duration-seconds=40",
                *[f"--config={stage}" for stage in kwok_stage_files()],
            ],
        )

    def _create_crds(self) -> None:
        # A fresh etcd each run, so plain create: server-side apply of KubeRay's
        # megabyte-sized schemas costs the API server twice the CPU.
        upstream = kuberay_crd_files() + monitoring_crd_files()
        self.kubectl("create", *[f"--filename={path}" for path in upstream])
        # The project's own CRDs are under test: one the API server refuses must fail
        # the tests that use it (they read crd_errors), not the whole control plane.
        for path in sorted(p for d in self.crd_dirs for p in d.glob("*.yaml")):
            result = self.kubectl("create", "-f", str(path), check=False)
            if result.returncode != 0:
                self.crd_errors[path.name] = result.stderr.strip()
                with open(self.logs_dir / "crds.log", "a") as log:
                    log.write(f"kubectl create -f {path} failed:\n{result.stderr}\n")

    def wait_crds_established(self) -> None:
        """After CRDs were created or replaced: until every CRD is Established, and the
        API server has built its OpenAPI document again."""
        # Polled here: `kubectl wait` gives up on a CRD whose status is still empty.
        self._wait("CRDs Established", self._crds_established, None, timeout=120)
        # The API server builds its OpenAPI v2 document again at the first request after
        # CRDs changed: with KubeRay's and Kueue's schemas, 30 s and more on a busy
        # machine. kubectl asks for it before every create or apply and gives up after
        # 32 s (a test's `kubectl apply` failed so, right after Kueue's CRDs came). Asked
        # here once, it is built before any kubectl needs it.
        url = f"{self.server}/openapi/v2"
        with urllib.request.urlopen(url, context=self._client_tls, timeout=300) as document:
            document.read()

    def _crds_established(self) -> bool:
        crds = json.loads(self.kubectl("get", "crd", "-o", "json").stdout)["items"]
        return all(_has_condition(crd, "Established") for crd in crds)

    def _start_kuberay(self) -> None:
        """Start KubeRay's operator on ports picked now, and wait until both its probe
        and its metrics answer: it exits when either port is taken, and its probe may
        answer once before that."""
        metrics, probe = free_ports(2)
        proc = self._spawn(
            "kuberay-operator",
            [
                BIN_DIR / "kuberay-operator",
                f"--metrics-addr=127.0.0.1:{metrics}",
                f"--health-probe-bind-address=127.0.0.1:{probe}",
                "--enable-leader-election=false",
                "--log-stdout-encoder=console",
                # KubeRay runs outside the cluster here, where a head Service's DNS name
                # and ClusterIP mean nothing: it asks each head's dashboard (a job's
                # status) through the API server's service proxy instead.
                "--use-kubernetes-proxy",
            ],
            env={"KUBECONFIG": str(self.kubeconfig)},
        )
        self._wait(
            "kuberay-operator",
            lambda: (
                _http_get(f"http://127.0.0.1:{probe}/readyz") == 200
                and _http_get(f"http://127.0.0.1:{metrics}/metrics") == 200
            ),
            proc,
            timeout=60,
        )

    def start_kueue(self) -> None:
        """Start Kueue's controller manager (once; it runs until the control plane stops).
        Only RayJobs labelled with a queue are Kueue's, so other tests see no change."""
        if any(p.name == "kueue" for p in self.processes):
            return
        if not can_run_kueue():
            raise ControlPlaneError("Kueue needs root and unshare here (see can_run_kueue)")
        self.kubectl("create", *[f"--filename={path}" for path in kueue_crd_files()])
        self.kubectl("create", "namespace", "kueue-system")
        self.wait_crds_established()
        # /etc/kueue/metrics/certs is where Kueue reads its metrics certificate: a private
        # /etc holds it (and the webhook's), seen by Kueue alone.
        etc = self.run_dir / "kueue-etc"
        certs = etc / "kueue" / "metrics" / "certs"
        certs.mkdir(parents=True)
        leaf_certificate(
            self.pki, "kueue", "/CN=kueue", "serverAuth", ["IP:127.0.0.1", "DNS:localhost"]
        )
        shutil.copy(self.pki / "kueue.crt", certs / "tls.crt")
        shutil.copy(self.pki / "kueue.key", certs / "tls.key")
        ports = dict(zip(("health", "metrics", "webhook"), free_ports(3), strict=True))
        config = self.run_dir / "kueue.yaml"
        config.write_text(yaml.safe_dump(kueue_config("kueue-system", ports, certs)))
        manager = f"{BIN_DIR / 'kueue-manager'} --config={config}"
        proc = self._spawn(
            "kueue",
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount --bind {etc} /etc && exec {manager}"],
            env={"KUBECONFIG": str(self.kubeconfig)},
        )  # fmt: skip
        ready = f"http://127.0.0.1:{ports['health']}/readyz"
        self._wait("kueue", lambda: _http_get(ready) == 200, proc, timeout=60)

    def _create_nodes(self) -> None:
        # Through the Python client: kubectl would first rediscover every API group,
        # which is slow right after CRDs were added.
        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            for node in node_manifests(self.node_groups):
                core.create_node(node)

    def _wait_ready(self) -> None:
        by_name = {p.name: p for p in self.processes}
        insecure = ssl._create_unverified_context()  # their serving certs are self-signed
        checks = {
            "kube-controller-manager": lambda: (
                _https_get(f"https://127.0.0.1:{self._ports['kcm']}/healthz", insecure) == 200
            ),
            "kube-scheduler": lambda: (
                _https_get(f"https://127.0.0.1:{self._ports['scheduler']}/healthz", insecure) == 200
            ),
            "kwok": lambda: _http_get(f"http://127.0.0.1:{self._ports['kwok']}/healthz") == 200,
        }
        for name, check in checks.items():
            self._wait(name, check, by_name[name], timeout=60)
        nodes = [n for g in self.node_groups for n in g.node_names()]
        self._wait("nodes Ready", lambda: self._nodes_ready(nodes), by_name["kwok"], timeout=60)
        if self.real_node:
            self._phase("real node ready", self._wait_real_node)
        # Pods are refused until the service-account controller made "default".
        self._wait(
            "default service account",
            lambda: self._has_default_sa("default"),
            by_name["kube-controller-manager"],
            timeout=60,
        )

    def _wait_real_node(self) -> None:
        node = self.real_node
        assert node is not None
        procs = {p.name: p for p in node.processes}
        for name, check in node.ready_checks().items():
            self._wait(name, check, procs[name], timeout=60)
        self._wait(f"node {node.name} Ready", lambda: self._nodes_ready([node.name]),
                   procs["kubelet"], timeout=60)  # fmt: skip
        node.after_ready()

    # ----- waiting

    def _wait(
        self, what: str, check: Callable[[], bool], proc: Process | None, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise ControlPlaneError(
                    f"{proc.name} exited (code {proc.popen.returncode}) while waiting for {what}:\n"
                    f"{tail(proc.log_path)}"
                )
            try:
                if check():
                    return
            except Exception as e:  # not up yet: connection refused, 503, not found, ...
                last_error = e
            time.sleep(0.2)
        log = f"\n{tail(proc.log_path)}" if proc else ""
        raise ControlPlaneError(
            f"timed out after {timeout}s waiting for {what} (last error: {last_error}){log}"
        )

    def _nodes_ready(self, names: list[str]) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False)
        if out.returncode != 0:
            return False
        nodes = json.loads(out.stdout)["items"]
        ready = {n["metadata"]["name"] for n in nodes if _has_condition(n, "Ready")}
        return set(names) <= ready

    def _has_default_sa(self, namespace: str) -> bool:
        return (
            self.kubectl(
                "get", "serviceaccount", "default", "-n", namespace, check=False
            ).returncode
            == 0
        )

    # ----- for tests and people

    def env(self) -> dict[str, str]:
        """Environment for programs that should talk to this cluster."""
        helm_home = self.run_dir / "helm"
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }

    def _run(
        self, argv: list[str], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, env=self.env(), timeout=timeout
        )
        if check and result.returncode != 0:
            raise ControlPlaneError(
                f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        argv = [
            str(BIN_DIR / "kubectl"),
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.run_dir / 'kube-cache'}",
            *args,
        ]
        return self._run(argv, check, input, timeout)

    def helm(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        argv = [str(BIN_DIR / "helm"), f"--kubeconfig={self.kubeconfig}", *args]
        return self._run(argv, check, input, timeout)

    def api_client(self):
        """A kubernetes.client.ApiClient logged in as cluster admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def create_namespace(self, name: str) -> None:
        """Create a namespace and wait until pods can be created in it."""
        self.kubectl("create", "namespace", name)
        self.wait_for_default_service_account(name)

    def wait_for_default_service_account(self, name: str) -> None:
        """Until pods can be created in namespace `name`."""
        self._wait(
            f"service account default in {name}",
            lambda: self._has_default_sa(name),
            None,
            timeout=60,
        )

    def log_tails(self, lines: int = 25) -> dict[str, str]:
        return {p.name: tail(p.log_path, lines) for p in self._all_logs()}

    def _all_logs(self) -> list[Process]:
        return [Process(path.stem, [], path) for path in sorted(self.logs_dir.glob("*.log"))]
