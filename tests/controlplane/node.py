"""A real Kubernetes node beside kwok's fake ones: kubelet and kube-proxy (from the
control plane's own k8s.io/kubernetes module), containerd + runc + CNI plugins (Debian's),
and CoreDNS as cluster DNS. Pods on it really run.

    host (before the API server): lock, network (node_host), containerd, pause image
    agents (once the API server is up): kubelet, kube-proxy, CoreDNS
    ready: the node Ready, DNS synced; the machine's kernel settings put back

The node is tainted, so the tests that rely on kwok fake-running their pods never land
on it; a pod that should run for real says so with ``on_real_node(spec)``. It starts
only where it can (``unavailable_reason``); ``RLHF_REAL_NODE`` = ``auto`` (default),
``off`` or ``require`` (fail rather than start without it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import BIN_DIR, SERVICE_CIDR, ControlPlaneError
from .node_config import (
    CNI_BIN_DIR,
    NodeLayout,
    containerd_toml,
    corefile,
    dump_yaml,
    kube_proxy_config,
    kubelet_config,
    write_cni_conf,
)
from .node_host import (
    IP_FORWARD,
    KUBELET_SYSCTLS,
    NodeLock,
    read_sysctls,
    setup_network,
    teardown_network,
    unmount_all,
    write_sysctls,
)
from .oci import archive_identity, write_image
from .processes import Process, free_ports, tail

REAL_NODE_NAME = "real-0"
REAL_NODE_LABEL_KEY = "rlhf.dev/real-node"
REAL_NODE_LABELS = {REAL_NODE_LABEL_KEY: "true"}
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL_KEY, "value": "true", "effect": "NoSchedule"}
REAL_NODE_TOLERATION = {"key": REAL_NODE_LABEL_KEY, "operator": "Exists", "effect": "NoSchedule"}

# Private addresses no route of this machine uses. kwok gives fake pods 10.244.0.0/16.
NODE_IP = "10.246.0.1"
POD_SUBNET = "10.245.0.0/24"
CLUSTER_POD_CIDR = "10.244.0.0/15"
BRIDGE = "rlhf-cni0"
NODE_LINK = "rlhf-node0"
# Fixed places (not per run): a killed run's containers and mounts are found and
# cleaned by the next start, and images stay imported between runs.
STATE_DIR = Path("/run/rlhf-test-node")
DATA_DIR = Path("/var/lib/rlhf-test-node")
LOCK_FILE = Path("/run/rlhf-test-node.lock")

PAUSE_IMAGE = "rlhf.local/pause:1"
NETTOOL_IMAGE = "rlhf.local/nettool:1"
IMAGE_LABEL = "rlhf.dev/archive"  # on each imported image: what archive it came from
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns", "pause", "nettool", "kube-network-policies")
HOST_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "iptables", "ip")
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
MODE_ENV = "RLHF_REAL_NODE"
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"


def on_real_node(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """A copy of a pod spec that runs on the real node (and only there)."""
    spec = copy.deepcopy(pod_spec)
    spec.setdefault("nodeSelector", {}).update(REAL_NODE_LABELS)
    spec.setdefault("tolerations", []).append(REAL_NODE_TOLERATION)
    return spec


def node_mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto")
    if mode not in ("auto", "off", "require"):
        raise ControlPlaneError(f"{MODE_ENV}={mode!r}: expected auto, off or require")
    return mode


def unavailable_reason() -> str | None:
    """Why the real node cannot start here, or None if it can."""
    if node_mode() == "off":
        return f"the real node is off ({MODE_ENV}=off)"
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the real node needs root on Linux (network, mounts, containerd)"
    missing = [str(BIN_DIR / b) for b in NODE_BINARIES if not (BIN_DIR / b).is_file()]
    path = f"{os.environ.get('PATH', '')}:{SBIN_PATH}"
    missing += [c for c in HOST_COMMANDS if shutil.which(c, path=path) is None]
    missing += [str(CNI_BIN_DIR / p) for p in CNI_PLUGINS if not (CNI_BIN_DIR / p).is_file()]
    if missing:
        return (
            f"the real node lacks {', '.join(missing)} (make controlplane, as root, installs them)"
        )
    return None


def start_real_node(run_dir: Path, logs_dir: Path, pki: Path) -> tuple[RealNode | None, str]:
    """A real node with its host side started, or None and why there is none. Under
    RLHF_REAL_NODE=require, a node that cannot start raises instead."""
    reason = unavailable_reason()
    if reason is None:
        node = RealNode(run_dir, logs_dir, pki)
        try:
            node.start_host()
            return node, ""
        except Exception as e:
            reason = f"the real node failed to start: {e}"
            with contextlib.suppress(Exception):
                node.stop()
    if node_mode() == "require":
        raise ControlPlaneError(reason)
    return None, reason


class RealNode:
    """One real node of a ControlPlane; see the module's docstring for its phases."""

    def __init__(self, run_dir: Path, logs_dir: Path, pki: Path):
        self.name = REAL_NODE_NAME
        self.node_ip = NODE_IP
        self.layout = NodeLayout(
            name=REAL_NODE_NAME,
            node_ip=NODE_IP,
            pod_subnet=POD_SUBNET,
            cluster_pod_cidr=CLUSTER_POD_CIDR,
            service_cidr=SERVICE_CIDR,
            bridge=BRIDGE,
            state_dir=STATE_DIR,
            data_dir=DATA_DIR,
            run_dir=run_dir,
        )
        self.logs_dir = logs_dir
        self.pki = pki
        self.processes: list[Process] = []
        self._lock = NodeLock(LOCK_FILE)
        self._saved_sysctls: dict[str, str] = {}
        self._ports: dict[str, int] = {}
        self._host_changed = False

    # ----- phases

    def start_host(self) -> None:
        """Everything the API server does not need: lock, network, containerd, pause."""
        self._lock.acquire(f"pid {os.getpid()}, run {self.layout.run_dir}")
        self._host_changed = True
        self._saved_sysctls = self._original_sysctls()
        if STATE_DIR.exists():  # a killed run's leftovers
            self._start_containerd()
            self._clean_runtime()
        teardown_network(self.layout, NODE_LINK)
        setup_network(self.layout, NODE_LINK)
        self.layout.run_dir.mkdir(parents=True, exist_ok=True)
        write_cni_conf(self.layout)
        (self.layout.run_dir / "resolv.conf").write_text(f"nameserver {NODE_IP}\noptions ndots:5\n")
        self._ports = dict(
            zip(("kubelet", "proxy", "proxy-metrics", "dns-ready"), free_ports(4), strict=True)
        )
        self._start_containerd()
        self.import_go_image("pause", PAUSE_IMAGE)

    def start_agents(self, kubeconfig: Path) -> None:
        """The kubelet, kube-proxy and CoreDNS: they need the API server; no waiting."""
        self._start_kubelet(kubeconfig)
        self._start_kube_proxy(kubeconfig)
        config = self.layout.run_dir / "Corefile"
        config.write_text(corefile(self.layout, kubeconfig, self._ports["dns-ready"]))
        self._spawn("coredns", [BIN_DIR / "coredns", "-conf", config])

    def ready_checks(self) -> dict[str, Callable[[], bool]]:
        """Health checks of the agents (name -> callable returning True when ready)."""
        return {
            "kubelet": lambda: _http_ok(f"http://127.0.0.1:{self._ports['kubelet']}/healthz"),
            "kube-proxy": lambda: _http_ok(f"http://127.0.0.1:{self._ports['proxy']}/healthz"),
            "coredns": lambda: _http_ok(f"http://127.0.0.1:{self._ports['dns-ready']}/ready"),
        }

    def after_ready(self) -> None:
        """The kubelet is past its start: give the machine its kernel settings back."""
        write_sysctls({k: v for k, v in self._saved_sysctls.items() if k != IP_FORWARD})

    def stop_agents(self) -> None:
        """Stop the API server's clients (kubelet, kube-proxy, CoreDNS); containerd and
        the node's address stay, for the API server to shut down cleanly."""
        while self.processes and self.processes[-1].name != "containerd":
            self.processes.pop().stop()

    def stop(self) -> None:
        """Undo everything start_host and start_agents did; every step runs even if one
        before it failed, and the failures are raised together at the end."""
        if not self._host_changed:
            return
        errors: list[str] = []
        self.stop_agents()
        for step in (
            self._clean_runtime,
            lambda: teardown_network(self.layout, NODE_LINK),
            lambda: write_sysctls(self._saved_sysctls),
            lambda: (DATA_DIR / "sysctls.json").unlink(missing_ok=True),
        ):
            try:
                step()
            except Exception as e:  # go on cleaning: the machine matters more
                errors.append(f"{type(e).__name__}: {e}")
        self._host_changed = False
        self._lock.release()
        if errors:
            raise ControlPlaneError("the real node did not stop cleanly:\n" + "\n".join(errors))

    # ----- images

    def load_image(self, archive: Path, base_name: str | None = None) -> list[str]:
        """Import an OCI image-layout or docker archive into the node's containerd (the
        CRI's k8s.io namespace); skipped when an image from the same archive content is
        there already. Returns the image names (e.g. docker.io/library/x:1)."""
        identity = archive_identity(archive)
        known = self.ctr("images", "ls", "-q", f'labels."{IMAGE_LABEL}"=={identity}').stdout.split()
        if known:
            return known
        extra = ["--base-name", base_name] if base_name else []
        out = self.ctr("images", "import", *extra, str(archive), timeout=1800).stdout
        refs = re.findall(r"^unpacking (\S+) \(", out, flags=re.MULTILINE)
        if not refs:
            raise ControlPlaneError(f"ctr imported no named image from {archive}:\n{out}")
        for ref in refs:
            self.ctr("images", "label", ref, f"{IMAGE_LABEL}={identity}")
        return refs

    def import_go_image(self, binary: str, ref: str, stop_signal: str | None = None) -> list[str]:
        """An image of one static binary from bin/ (go/node), imported as `ref`."""
        archive = DATA_DIR / "images" / f"{binary}.tar"
        write_image(BIN_DIR / binary, ref, [f"/{binary}"], archive, stop_signal)
        return self.load_image(archive)

    def ctr(
        self, *args: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ctr against the node's containerd, in the CRI's namespace."""
        socket = str(self.layout.containerd_socket)
        argv = ["ctr", "--address", socket, "--namespace", "k8s.io", *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env())
        if check and result.returncode != 0:
            raise ControlPlaneError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
        return result

    # ----- components

    def _spawn(self, name: str, argv: list[Any]) -> Process:
        proc = Process(name, argv, self.logs_dir / f"{name}.log", env=_env())
        proc.start()
        self.processes.append(proc)
        return proc

    def _start_containerd(self) -> None:
        if any(p.name == "containerd" and p.alive() for p in self.processes):
            return
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        config = self.layout.run_dir / "containerd.toml"
        self.layout.run_dir.mkdir(parents=True, exist_ok=True)
        config.write_text(containerd_toml(self.layout, PAUSE_IMAGE))
        proc = self._spawn("containerd", ["containerd", "--config", config])
        _wait("containerd", lambda: self.ctr("version", timeout=5) is not None, proc, 30)

    def _start_kubelet(self, kubeconfig: Path) -> None:
        self.layout.kubelet_root.mkdir(parents=True, exist_ok=True)
        (self.layout.run_dir / "pod-logs").mkdir(parents=True, exist_ok=True)
        config = kubelet_config(
            self.layout, self.pki / "ca.crt", self._ports["kubelet"], [REAL_NODE_TAINT]
        )
        labels = ",".join(f"{k}={v}" for k, v in REAL_NODE_LABELS.items())
        self._spawn(
            "kubelet",
            [
                BIN_DIR / "kubelet",
                f"--config={dump_yaml(self.layout.run_dir / 'kubelet.yaml', config)}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.layout.kubelet_root}",
                f"--hostname-override={self.name}",
                f"--node-ip={NODE_IP}",
                f"--node-labels={labels}",
            ],
        )

    def _start_kube_proxy(self, kubeconfig: Path) -> None:
        config = kube_proxy_config(
            self.layout, kubeconfig, self._ports["proxy"], self._ports["proxy-metrics"]
        )
        path = dump_yaml(self.layout.run_dir / "kube-proxy.yaml", config)
        self._spawn("kube-proxy", [BIN_DIR / "kube-proxy", f"--config={path}"])

    # ----- clean-up

    def _clean_runtime(self) -> None:
        """Kill and delete every container, stop containerd, unmount what it and the
        kubelet mounted, and forget their state."""
        try:
            self._remove_containers()
        finally:
            while self.processes:
                self.processes.pop().stop()
            unmount_all(STATE_DIR, self.layout.kubelet_root)
            shutil.rmtree(STATE_DIR, ignore_errors=True)
            shutil.rmtree(self.layout.kubelet_root, ignore_errors=True)

    def _remove_containers(self) -> None:
        # One task at a time, and again if some are left: deleting a pod's sandbox ends
        # the shim it shares with the pod's other containers, failing their deletion.
        for _ in range(3):
            listing = self.ctr("tasks", "ls").stdout.splitlines()[1:]
            for task in (line.split()[0] for line in listing):
                self.ctr("tasks", "rm", "--force", task, check=False)
            containers = self.ctr("containers", "ls", "-q").stdout.split()
            if not containers:
                return
            self.ctr("containers", "rm", *containers, check=False)
        raise ControlPlaneError(f"containers left in the node's containerd: {containers}")

    def _original_sysctls(self) -> dict[str, str]:
        """The machine's own settings: saved on disk before the first change, so that a
        start after a killed run restores those, not the ones the kubelet left."""
        saved = DATA_DIR / "sysctls.json"
        if saved.is_file():
            values: dict[str, str] = json.loads(saved.read_text())
            return values
        values = read_sysctls((IP_FORWARD, *KUBELET_SYSCTLS))
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(values))
        return values


def _env() -> dict[str, str]:
    return {"PATH": f"{os.environ.get('PATH', '')}:{SBIN_PATH}"}


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


def _wait(what: str, check: Callable[[], bool], proc: Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not proc.alive():
            raise ControlPlaneError(f"{proc.name} exited while starting:\n{tail(proc.log_path)}")
        try:
            if check():
                return
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.1)
    raise ControlPlaneError(f"timed out waiting for {what} ({last}):\n{tail(proc.log_path)}")
