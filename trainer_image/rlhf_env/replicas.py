"""An environment's replicas as the trainer sees them: sessions spread, a dead one left.

An operator-run environment is N pods behind a headless Service, whose DNS name answers
with each ready pod's address. A session lives in one replica's memory, so every call
of a session goes to the replica that started it, and a new session goes to the replica
with the fewest open. The name is looked up again every RESOLVE_SECONDS, so replicas
added or removed while the job runs are used. A replica found unreachable is left out
of new sessions for DOWN_SECONDS (its pod is restarted, or leaves the DNS answer).

    replicas = EnvironmentReplicas("http://job-env-lookup:8000")
    async with replicas.session() as environment:  # an EnvironmentClient
        started = await environment.start(row)

A URL with https, or whose host does not resolve, is one replica, called as given.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from rlhf_env.client import EnvironmentClient

RESOLVE_SECONDS = 5.0
DOWN_SECONDS = 30.0

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
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._resolve, self._resolve_seconds = resolve, resolve_seconds
        self._resolved_at = -float("inf")
        self._current: list[str] = []  # the replicas' base URLs, as last resolved
        self._clients: dict[str, EnvironmentClient] = {}  # by base URL, the replicas now
        self._open: dict[str, int] = {}  # sessions open, by base URL
        self._down_until: dict[str, float] = {}  # by base URL: found unreachable

    @asynccontextmanager
    async def session(self, avoid: Collection[str] = ()) -> AsyncIterator[EnvironmentClient]:
        """The client of the replica for a new session, counted as open on it while
        inside: the one with the fewest open sessions, not found down, and not in
        `avoid` (base URLs) unless every replica is."""
        client = await self._pick(avoid)
        self._open[client.url] = self._open.get(client.url, 0) + 1
        try:
            yield client
        finally:
            self._open[client.url] -= 1

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
                        url, timeout=self.timeout, headers={"Host": host}
                    )
        return self._current
