"""Processes and ports for the test harness: each component in its own process group
(stopped with it, even when the test process is killed outright), its output in a log
file, on a loopback port no other component was given."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

LOWEST_PORT = 10000
# Every port free_ports gave in this process: free until its owner binds it, so never
# given again (the real node's kube-proxy once got the port picked for KubeRay's metrics,
# which starts later, and KubeRay exited: "address already in use").
_given: set[int] = set()


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together so none repeats), none given
    before in this process, below the kernel's ephemeral range: it hands those to
    outgoing connections, and one (the apiserver's or Ray's) once took kwok's port
    between its pick and kwok's bind."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = random.sample(range(LOWEST_PORT, ephemeral_low), ephemeral_low - LOWEST_PORT)
    candidates = [port for port in candidates if port not in _given]
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == count:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken
                s.close()
                continue
            socks.append(s)
        if len(socks) < count:
            raise RuntimeError(f"fewer than {count} free ports in {LOWEST_PORT}-{ephemeral_low}")
        ports = [s.getsockname()[1] for s in socks]
        _given.update(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    # If the Python process is killed outright (no atexit), the kernel still stops
    # the components instead of leaving them running.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Process:
    """One component in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = env
        self.popen: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        # Whatever is left in the group (the leader or any child) gets SIGKILL.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)
