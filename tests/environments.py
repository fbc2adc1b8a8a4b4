"""Environment servers for tests: the real protocol server (rlhf_env.server) under a real
uvicorn, on a free port of 127.0.0.1, in a thread of the test process; Chatter, an
environment whose every episode has CHATTER_TURNS turns, whatever the model says; and
Replica, a Chatter that says which process played it and can die mid-session."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from rlhf_env.protocol import Message, Start, Step

START_SECONDS = 10


@contextmanager
def served(apps: Mapping[str, FastAPI], port: int = 0) -> Iterator[str]:
    """The base URL of a server with each app mounted at /<name>; stopped on leaving
    (its port then refuses connections). `port`: 0 for any free one."""
    root = FastAPI()
    for path, app in apps.items():
        root.mount(f"/{path}", app)
    server = uvicorn.Server(uvicorn.Config(root, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_SECONDS
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=START_SECONDS)


CHATTER_TURNS = 3
CHATTER_REPLY = "b c"  # a user message, between turns


class Chatter:
    """Answers every turn with the user message CHATTER_REPLY until CHATTER_TURNS turns
    (a random tiny model's episodes still have several turns); scores the number of
    words the model said. Its first message is the row's key (toy:lookup's rows)."""

    async def reset(self, row: dict[str, Any]) -> Start:
        self.turns, self.words = 0, 0
        return Start(messages=[Message(role="user", content=str(row.get("key", "a")))])

    async def step(self, message: Message) -> Step:
        self.turns += 1
        self.words += len((message.content or "").split())
        reply = Message(role="user", content=CHATTER_REPLY)
        return Step(messages=[reply], done=self.turns == CHATTER_TURNS)

    async def score(self) -> float:
        return float(self.words)


class Replica(Chatter):
    """A Chatter that scores its server's process id (which replica played the episode).
    A row with `die_once: <path>` kills the server at its episode's second step, with
    SIGKILL, if no file is at that path yet (it creates one first): the first replica to
    get there dies mid-session, once; a restart of the episode elsewhere goes on."""

    async def reset(self, row: dict[str, Any]) -> Start:
        self.marker = row.get("die_once")
        return await super().reset(row)

    async def step(self, message: Message) -> Step:
        if self.turns == 1 and self.marker is not None and _created(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().step(message)

    async def score(self) -> float:
        return float(os.getpid())


def _created(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class Unreliable(Chatter):
    """A Chatter whose server fails two of its sessions, each at the session's first
    step, on an event: the UNRELIABLE_HANGS-th session of the process hangs past the
    caller's limit, the UNRELIABLE_FAILS-th raises (an HTTP 500). The rest play as
    Chatter does."""

    started = 0  # sessions reset in this process

    async def reset(self, row: dict[str, Any]) -> Start:
        Unreliable.started += 1
        self.number = Unreliable.started
        return await super().reset(row)

    async def step(self, message: Message) -> Step:
        if self.turns == 0 and self.number == UNRELIABLE_HANGS:
            await asyncio.sleep(UNRELIABLE_HANG_SECONDS)
        if self.turns == 0 and self.number == UNRELIABLE_FAILS:
            raise RuntimeError("the tool broke")
        return await super().step(message)


UNRELIABLE_HANGS, UNRELIABLE_FAILS = 2, 4
UNRELIABLE_HANG_SECONDS = 5.0  # past the tests' toolCallTimeoutSeconds
