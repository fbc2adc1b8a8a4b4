"""An environment's replicas as the trainer sees them: sessions spread, a dead one left.

An operator-run environment is N pods behind a headless Service, whose DNS name answers
with each ready pod's address. A session lives in one replica's memory, so every call
of a session goes to the replica that started it, and a new session goes to the replica
with the fewest open. The name is looked up again every RESOLVE_SECONDS, so replicas
added or removed while the job runs are used. A replica found unreachable is left out
of new sessions for DOWN_SECONDS (its pod is restarted, or leaves the DNS answer).

A session's `start` that a replica refuses (no connection opens, or it answers 503: it
holds as many sessions as it may) is made on the next replica, within the call's
deadline; when every replica is full, it waits for room, up to that deadline.

    replicas = EnvironmentReplicas("http://job-env-lookup:8000")
    async with replicas.session() as environment:  # an EnvironmentClient
        started = await environment.start(row)

A URL with https, or whose host does not resolve, is one replica, called as given.

Another protocol of one call a session (an agent's episodes: rlhf_trainer.rollout.
agent_client) spreads the same way: its call is the session's `first_call`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit

from rlhf_env.client import EnvironmentCallFailed, EnvironmentClient
from rlhf_env.protocol import Started

Answer = TypeVar("Answer")

RESOLVE_SECONDS = 5.0
DOWN_SECONDS = 30.0
FULL_WAIT_SECONDS = (0.05, 1.0)  # every replica full: wait this long, doubling to the most

# an environment's URL -> one base URL per replica (resolve_replicas; tests name theirs)
Resolve = Callable[[str], Awaitable[list[str]]]


async def resolve_replicas(url: str) -> list[str]:
    """One base URL per address the URL's host resolves to (a headless Service: one per
    ready pod), with the URL's port and path. IPv4 addresses when there are any: a
    dual-stack pod has one of each, and one replica must not count twice."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        return [url]
    port = parts.port or 80
    try:
        found = await asyncio.get_running_loop().getaddrinfo(
            parts.hostname, port, type=socket.SOCK_STREAM
        )
    except OSError:
        return [url]  # the call will fail, naming the URL as the user gave it
    v4 = sorted({str(info[4][0]) for info in found if info[0] == socket.AF_INET})
    v6 = sorted({f"[{info[4][0]}]" for info in found if info[0] == socket.AF_INET6})
    return [parts._replace(netloc=f"{host}:{port}").geturl() for host in v4 or v6] or [url]


class EnvironmentReplicas:
    """The replicas of one environment, and the sessions open on each. Used on one
    event loop (the rollout engine's): its counters need no lock."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        resolve: Resolve = resolve_replicas,
        resolve_seconds: float = RESOLVE_SECONDS,
        service: str = "environment",
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout, self.service = timeout, service
        self._resolve, self._resolve_seconds = resolve, resolve_seconds
        self._resolved_at = -float("inf")
        self._current: list[str] = []  # the replicas' base URLs, as last resolved
        self._clients: dict[str, EnvironmentClient] = {}  # by base URL, the replicas now
        self._open: dict[str, int] = {}  # sessions open, by base URL
        self._down_until: dict[str, float] = {}  # by base URL: found unreachable

    @asynccontextmanager
    async def session(self, avoid: Collection[str] = ()) -> AsyncIterator[PlacedSession]:
        """The client of a new session, counted as open on its replica while inside: the
        one with the fewest open sessions, not found down, and not in `avoid` (base
        URLs) unless every replica is; another if that one refuses its `start`."""
        placed = PlacedSession(self, await self._pick(avoid), avoid)
        try:
            yield placed
        finally:
            self._open[placed.url] -= 1

    def _count(self, client: EnvironmentClient, moved_from: str | None = None) -> None:
        if moved_from is not None:
            self._open[moved_from] -= 1
        self._open[client.url] = self._open.get(client.url, 0) + 1

    async def _next(self, tried: Collection[str]) -> EnvironmentClient | None:
        """The replica with the fewest open sessions outside `tried` and not down."""
        replicas = await self._replicas()
        usable = self._usable(replicas, tried)
        if not usable:
            return None
        chosen = min(usable, key=lambda url: (self._open.get(url, 0), replicas.index(url)))
        return self._clients[chosen]

    def mark_down(self, replica: str) -> None:
        """A replica that did not answer: new sessions go elsewhere for a while."""
        self._down_until[replica] = time.monotonic() + DOWN_SECONDS

    async def others(self, tried: Collection[str]) -> bool:
        """Whether a replica outside `tried`, and not down, is there to restart on."""
        return bool(self._usable(await self._replicas(), tried))

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()

    async def _pick(self, avoid: Collection[str]) -> EnvironmentClient:
        replicas = await self._replicas()
        usable = self._usable(replicas, avoid) or replicas
        chosen = min(usable, key=lambda url: (self._open.get(url, 0), replicas.index(url)))
        return self._clients[chosen]

    def _usable(self, replicas: list[str], avoid: Collection[str]) -> list[str]:
        now = time.monotonic()
        return [
            url
            for url in replicas
            if url not in avoid and self._down_until.get(url, -float("inf")) <= now
        ]

    async def _replicas(self) -> list[str]:
        """The replicas' base URLs, looked up again once RESOLVE_SECONDS old. The client
        of a replica that left is closed once no session is open on it (pods come and go
        with new addresses: their clients must not pile up)."""
        if time.monotonic() - self._resolved_at >= self._resolve_seconds:
            self._current = [url.rstrip("/") for url in await self._resolve(self.url)]
            self._resolved_at = time.monotonic()  # after: a session picked meanwhile waits too
            for url in [u for u in self._clients if u not in self._current]:
                if not self._open.get(url):
                    await self._clients.pop(url).aclose()
            host = urlsplit(self.url).netloc
            for url in self._current:
                if url not in self._clients:
                    # By address, with the Host the user named (a proxy may route by it).
                    self._clients[url] = EnvironmentClient(
                        url, timeout=self.timeout, headers={"Host": host}, service=self.service
                    )
        return self._current


class PlacedSession(EnvironmentClient):
    """One session's client: its `start` goes to the replica chosen for it, or, when
    that one refuses (EnvironmentCallFailed.refused), to the next; every later call goes
    to the replica that started it (`url`). It borrows the replicas' clients and their
    connections, so it opens and closes none."""

    def __init__(
        self, replicas: EnvironmentReplicas, first: EnvironmentClient, avoid: Collection[str]
    ) -> None:  # no EnvironmentClient.__init__: no connections of its own
        self._replicas, self._avoid = replicas, list(avoid)
        self._on = first
        self.url, self.timeout = first.url, first.timeout
        self.max_answer_bytes, self.service = first.max_answer_bytes, first.service
        replicas._count(first)

    async def start(self, row: dict[str, Any], *, timeout: float | None = None) -> Started:
        return await self.first_call(lambda on, left: on.start(row, timeout=left), timeout)

    async def first_call(
        self,
        send: Callable[[EnvironmentClient, float], Awaitable[Answer]],
        timeout: float | None = None,
    ) -> Answer:
        """`send(replica's client, seconds left)`, the session's first call: made on the
        next replica while one refuses it, within `timeout` in all."""
        whole = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + whole
        tried: list[str] = []
        wait = FULL_WAIT_SECONDS[0]
        left = whole  # the first try gets the deadline as given (its failure names it so)
        while True:
            try:
                return await send(self._on, max(left, 0.001))
            except EnvironmentCallFailed as failed:
                if not failed.refused:
                    raise
                if not failed.connected:
                    self._replicas.mark_down(self._on.url)
                tried.append(self._on.url)
                following = await self._replicas._next([*tried, *self._avoid])
                if following is None and failed.status == 503 and left > wait:
                    await asyncio.sleep(wait)  # all full: room comes as sessions close
                    wait = min(wait * 2, FULL_WAIT_SECONDS[1])
                    tried.clear()
                    following = await self._replicas._next(self._avoid)
                if following is None:
                    raise
                self._move(following)
                left = deadline - time.monotonic()

    def _move(self, client: EnvironmentClient) -> None:
        self._replicas._count(client, moved_from=self._on.url)
        self._on, self.url = client, client.url

    async def _request(self, *args: Any) -> Any:
        return await self._on._request(*args)

    @property
    def is_closed(self) -> bool:
        return self._on.is_closed

    async def aclose(self) -> None:
        """Nothing: the replicas' clients are EnvironmentReplicas.aclose's to close."""
