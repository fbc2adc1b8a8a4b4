"""The operator image, built with buildah (seconds when its inputs are unchanged), runs
as its numeric user and loads into a containerd of its own, which then holds the very
image buildah built; a second load sends nothing. The real node's tests
(tests/controlplane) load both images and run them as pods. The environment image serves
the environment protocol from its own entrypoint."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_env.client import EnvironmentCallFailed, EnvironmentClient
from rlhf_env.process import free_port
from rlhf_env.protocol import FunctionCall, Message, ToolCall
from tests.conftest import needs
from tests.images.build import ensure, image_id
from tests.images.load import containerd_image_id, load


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: buildah builds and containerd runs as root here"
    for tool in ("buildah", "mmdebstrap", "containerd", "ctr"):
        if shutil.which(tool) is None:
            return f"no {tool} (make images installs buildah and mmdebstrap; containerd: apt-get install containerd)"
    return None


pytestmark = [pytest.mark.slow, needs(_missing())]


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[str]:
    """A containerd with its own root, state and socket, and no CRI plugin (no node here)."""
    socket = tmp_path / "containerd.sock"
    config = tmp_path / "config.toml"
    config.write_text(
        f'version = 2\nroot = "{tmp_path / "root"}"\nstate = "{tmp_path / "state"}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{socket}"\n'
    )
    with (tmp_path / "containerd.log").open("w") as log:
        process = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(
            ["ctr", "--address", str(socket), "version"], capture_output=True
        ).returncode:
            assert process.poll() is None, (tmp_path / "containerd.log").read_text()
            assert time.monotonic() < deadline, "containerd did not answer in 30 s"
            time.sleep(0.2)
        yield str(socket)
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(tmp_path / "root", ignore_errors=True)  # the unpacked image


def test_the_operator_image_runs_as_its_user_and_loads_once(
    containerd: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = ensure(["operator"])["operator"]

    container = subprocess.run(
        ["buildah", "from", "--quiet", ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        script = "id -u; cd /tmp && python -m rlhf_operator --help"
        command = ["buildah", "run", "--isolation=chroot", container, "--", "sh", "-c", script]
        ran = subprocess.run(command, check=True, capture_output=True, text=True)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    uid, _, usage = ran.stdout.partition("\n")
    assert uid == "10001"
    assert "usage: python -m rlhf_operator" in usage

    name = load(ref, containerd, name="rlhf-operator:test")
    assert name == "docker.io/library/rlhf-operator:test"
    assert containerd_image_id(name, containerd) == image_id(ref)
    capsys.readouterr()
    load(ref, containerd, name="rlhf-operator:test")
    assert "already in" in capsys.readouterr().err


def test_the_environment_image_serves_the_protocol_without_the_trainers_stack() -> None:
    """What an environment pod runs: its entrypoint serves LetterLookup (the default
    class) as uid 1000, a session plays to its score, and torch is not in the image."""
    ref = ensure(["environment"])["environment"]
    container = subprocess.run(
        ["buildah", "from", "--quiet", ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    port = free_port()
    try:
        check = "id -u; python -c 'import torch' 2>&1 | tail -1"
        command = ["buildah", "run", "--isolation=chroot", container, "--", "sh", "-c", check]
        ran = subprocess.run(command, check=True, capture_output=True, text=True)
        assert ran.stdout.splitlines() == ["1000", "ModuleNotFoundError: No module named 'torch'"]
        # The image's own entrypoint, on the host's network (chroot isolation).
        serve = ["buildah", "run", "--isolation=chroot", container, "--", "python", "-m",
                 "rlhf_env", "serve", "--port", str(port), "rlhf_env.toys:LetterLookup"]  # fmt: skip
        with subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as server:
            try:
                score = asyncio.run(play_lookup(f"http://127.0.0.1:{port}", server))
            finally:
                server.terminate()
                server.wait(timeout=30)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    assert score == 1.0


async def play_lookup(url: str, server: subprocess.Popen[bytes]) -> float:
    """LetterLookup's ideal episode: call the key, then answer with its value."""
    async with EnvironmentClient(url, timeout=10) as client:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert (await client.health()).environment == "LetterLookup"
                break
            except EnvironmentCallFailed:
                assert server.poll() is None, server.stdout.read() if server.stdout else ""
                assert time.monotonic() < deadline, "the image's server did not answer in 60 s"
                await asyncio.sleep(0.5)
        started = await client.start({"key": "c", "value": "x"})
        [tool] = started.tools
        call = ToolCall(id="call-0", function=FunctionCall(name=tool.function.name,
                                                            arguments='{"key": "c"}'))  # fmt: skip
        stepped = await client.step(started.session, Message(role="assistant", tool_calls=[call]))
        value = stepped.messages[0].content
        await client.step(started.session, Message(role="assistant", content=value))
        score = await client.score(started.session)
        await client.close(started.session)
        return score
