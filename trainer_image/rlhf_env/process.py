"""An environment server in a process of its own on this machine: what a local run
(`rlhfjob train`, `make demo`) starts for an environment the spec names by its class,
or an agent by its function (`command="agent"`).

    with served_locally("rlhf_env.toys:LetterLookup") as url:
        ...  # url is http://127.0.0.1:<a free port>, answering its health check
    with served_locally("examples.agents.letters_agent:run", command="agent") as url:
        ...

The server is `python -m rlhf_env serve` (or `agent`), on the loopback address: the
local run's rollout workers are processes of this machine. It is stopped on leaving, and
one that exits or never answers fails with its own output, naming the class or function.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Literal

from rlhf_env.client import EnvironmentCallFailed, EnvironmentClient

START_SECONDS = 60.0  # importing a user's class may take a while (their dependencies)
STOP_SECONDS = 10.0

Command = Literal["serve", "agent"]  # python -m rlhf_env's: what it serves
SERVED: dict[Command, str] = {"serve": "environment", "agent": "agent"}


class EnvironmentDidNotStart(RuntimeError):
    pass


@contextmanager
def served_locally(
    target: str, options: Sequence[str] = (), command: Command = "serve"
) -> Iterator[str]:
    """Serve the class `target` (`module:Class`) until the block ends; yields its URL.
    `options`: more of `python -m rlhf_env serve`'s flags (`--call-seconds 30`, ...).
    command "agent": `target` is an agent function (`module:function`), served by `python
    -m rlhf_env agent` (its flags: `--max-episodes 4`)."""
    port = free_port()
    with tempfile.TemporaryFile() as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlhf_env", command, target, "--port", str(port),
             "--log-level", "warning", *options],
            stdout=output,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_healthy(url, server, target, output, SERVED[command])
            yield url
        finally:
            server.terminate()
            try:
                server.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_until_healthy(
    url: str,
    server: subprocess.Popen[bytes],
    target: str,
    output: IO[bytes],
    what: str = "environment",
) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        if server.poll() is not None:
            raise EnvironmentDidNotStart(
                f"the {what} {target} exited with status {server.returncode}: {read_all(output)}"
            )
        if answers(url):
            return
        if time.monotonic() > deadline:
            raise EnvironmentDidNotStart(
                f"the {what} {target} did not answer at {url} within "
                f"{START_SECONDS:g} s: {read_all(output)}"
            )
        time.sleep(0.1)


def answers(url: str) -> bool:
    async def health() -> None:
        async with EnvironmentClient(url, timeout=1.0) as client:
            await client.health()

    try:
        asyncio.run(health())
    except EnvironmentCallFailed:
        return False
    return True


def read_all(output: IO[bytes]) -> str:
    """The end of what the server wrote (its traceback, when it failed)."""
    output.seek(0)
    text = output.read().decode(errors="replace").strip()
    return text[-2000:] or "(no output)"


def free_port() -> int:
    """A port free now on the loopback address (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
