"""What the real node changes on the machine, and how it is undone.

The node's network is its own: a link of its own holds the node's address (where the
API server, kubelet and cluster DNS listen), a CNI bridge holds its pods. Nothing may leave
the machine, so the pod and Service ranges get blackhole routes (a packet neither
bridged nor DNAT'd locally is dropped), and a FORWARD guard drops whatever a pod sends
outside the cluster's ranges and whatever comes from outside to a pod.

Everything here is idempotent: ``teardown`` also cleans what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .node_config import NodeLayout

GUARD_PREFIX = "RLHF-NODE-"
# The chains kube-proxy, the kubelet (its canaries), the CNI portmap plugin and we add.
CHAIN_PREFIXES = ("KUBE-", "CNI-", GUARD_PREFIX)
TABLES = ("filter", "nat", "mangle")
# The kernel settings the kubelet changes at start (container_manager_linux.go):
# restored once the node is up, and on stop, so that the machine keeps its own.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
IP_FORWARD = "net/ipv4/ip_forward"


class NodeBusy(RuntimeError):
    """Another real node runs on this machine (two would fight over iptables)."""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
    return result


# --------------------------------------------------------------------------- lock


@dataclass
class NodeLock:
    """A machine-wide flock; the file says who holds it. The kernel releases it when the
    holder dies, so a crashed run never blocks the next."""

    path: Path
    _file: IO[str] | None = None

    def acquire(self, holder: str) -> None:
        f = open(self.path, "a+")  # noqa: SIM115 - held open until release()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise NodeBusy(
                f"another real node runs on this machine ({owner}; lock {self.path}): "
                "two would fight over iptables. Stop it, or set RLHF_REAL_NODE=off."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(holder)
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None


# --------------------------------------------------------------------------- sysctls


def read_sysctls(names: tuple[str, ...]) -> dict[str, str]:
    return {n: Path("/proc/sys", n).read_text().strip() for n in names}


def write_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        with contextlib.suppress(OSError):
            Path("/proc/sys", name).write_text(value)


# --------------------------------------------------------------------------- network


def routes(layout: NodeLayout) -> list[str]:
    return [layout.cluster_pod_cidr, layout.service_cidr]


def guard_rules(layout: NodeLayout) -> dict[str, list[list[str]]]:
    """The filter table's guard chains: FORWARD keeps pod traffic inside the cluster's
    ranges, and the machine from routing anything but its pods' packets (ip_forward is on
    while the node runs); INPUT lets the node's address be reached from this machine and
    its pods only."""
    pods, bridge = layout.cluster_pod_cidr, layout.bridge
    return {
        "FORWARD": [
            ["!", "-i", bridge, "!", "-o", bridge, "-j", "DROP"],
            ["-s", pods, "!", "-d", pods, "-j", "DROP"],
            ["-d", pods, "!", "-s", pods, "-j", "DROP"],
        ],
        "INPUT": [
            ["-d", layout.node_ip, "-i", "lo", "-j", "RETURN"],
            ["-d", layout.node_ip, "-i", bridge, "-j", "RETURN"],
            ["-d", layout.node_ip, "-j", "DROP"],
        ],
    }


def setup_network(layout: NodeLayout, node_link: str) -> None:
    # A bridge without ports stands for a dummy link: this kernel has no dummy driver.
    sh("ip", "link", "add", node_link, "type", "bridge")
    sh("ip", "addr", "add", f"{layout.node_ip}/32", "dev", node_link)
    sh("ip", "link", "set", node_link, "up")
    for cidr in routes(layout):
        sh("ip", "route", "add", "blackhole", cidr)
    for parent, rules in guard_rules(layout).items():
        chain = GUARD_PREFIX + parent
        sh("iptables", "-N", chain)
        for rule in rules:
            sh("iptables", "-A", chain, *rule)
        sh("iptables", "-I", parent, "1", "-j", chain)
    Path("/proc/sys", IP_FORWARD).write_text("1")  # pods' packets are routed by the host


def teardown_network(layout: NodeLayout, node_link: str) -> None:
    for link in (node_link, layout.bridge):
        sh("ip", "link", "del", link, check=False)
    for cidr in routes(layout):
        sh("ip", "route", "del", "blackhole", cidr, check=False)
    for command in ("iptables", "ip6tables"):
        for table in TABLES:
            remove_chains(command, table, CHAIN_PREFIXES)


def remove_chains(command: str, table: str, prefixes: tuple[str, ...]) -> None:
    """Delete the jumps to chains named with `prefixes`, then the chains themselves."""
    listing = sh(command, "-t", table, "-S", check=False).stdout.splitlines()
    ours = [line.split()[1] for line in listing if line.startswith("-N ")]
    ours = [c for c in ours if c.startswith(prefixes)]
    for line in listing:
        words = shlex.split(line)  # comments are quoted
        if words[:1] == ["-A"] and _target(words) in ours and not words[1].startswith(prefixes):
            sh(command, "-t", table, "-D", *words[1:], check=False)
    for chain in ours:
        sh(command, "-t", table, "-F", chain, check=False)
    for chain in ours:
        sh(command, "-t", table, "-X", chain, check=False)


def _target(words: list[str]) -> str | None:
    for flag in ("-j", "-g"):
        if flag in words[:-1]:
            return words[words.index(flag) + 1]
    return None


# --------------------------------------------------------------------------- mounts


def mounts_under(*roots: Path) -> list[str]:
    """Mount points under any of `roots`, deepest first (the order to unmount them)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
            points.append(point)
    return sorted(set(points), key=len, reverse=True)


def unmount_all(*roots: Path) -> None:
    for point in mounts_under(*roots):
        if sh("umount", point, check=False).returncode != 0:
            sh("umount", "--lazy", point, check=False)
