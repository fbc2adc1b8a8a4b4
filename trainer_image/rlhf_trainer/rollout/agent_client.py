"""The trainer's side of the agent protocol (rlhf_env.agent_protocol): episodes handed to
an agent service, spread over its replicas, bounded in number, and each failure named as
the cut reason of its episode.

    agents = AgentClient.of(config.agents[0], engines=2)
    try:
        result = await agents.run(EpisodeRequest(episode_id=..., task=row, base_url=...,
                                                 api_key=..., model=SERVED_MODEL,
                                                 deadline_seconds=600))
    except AgentEpisodeFailed as failed:
        trajectory.cut_short(failed.cut)  # "agent_timeout: agent 'coder' episode at ..."

An episode is one call, POST /episodes, that lasts as long as the agent's loop: the agent
gets the episode's deadline, and the call waits GRACE_SECONDS more for the agent's own
answer (its 504, or its reward sent at the last moment). A connection opens within
CONNECT_SECONDS or fails. The episode goes to the replica running the fewest of this
client's episodes; one that refuses it (no connection, or a 503: full) passes it to the
next (rlhf_env.replicas, the environments' spreading). One that fails after taking it
(its pod died mid-episode) is not retried: the gateway has recorded the calls made so far
under the episode's key, and a second run would mix with them.

Each failure is one AgentEpisodeFailed whose `reason` is one of AGENT_CUT_REASONS, the
kinds of rlhf_env.client.FailureKind, with the agent protocol's statuses read as they
mean: a 504 is the agent's deadline (agent_timeout), a 404, 405 or 422 a server that
does not speak the protocol as we do (agent_protocol).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any, get_args

from rlhf_env.agent_protocol import EPISODES_PATH, EpisodeRequest, EpisodeResult
from rlhf_env.client import ClosedOnExit, EnvironmentCallFailed, EnvironmentClient, FailureKind
from rlhf_env.protocol import Health
from rlhf_env.replicas import EnvironmentReplicas, Resolve, resolve_replicas
from rlhf_trainer.api.agents import AgentConfig

# The agent's answer may come this long after its deadline: its own 504, or a reward
# sent as the deadline struck.
GRACE_SECONDS = 5.0
AGENT_CUT_REASONS = tuple(f"agent_{kind}" for kind in get_args(FailureKind))
# The agent protocol's statuses that say more than "an error".
KIND_OF_STATUS: dict[int, FailureKind] = {
    504: "timeout",  # the agent ran past the episode's deadline (and cancelled its run)
    404: "protocol",  # no /episodes there: not an agent, or another protocol's version
    405: "protocol",
    422: "protocol",  # the agent refused the request's shape
}


class AgentEpisodeFailed(Exception):
    """An episode the agent did not end with a result; `reason` is its cut reason."""

    def __init__(self, failed: EnvironmentCallFailed) -> None:
        self.failed = failed
        known = KIND_OF_STATUS.get(failed.status) if failed.status is not None else None
        self.kind: FailureKind = known or failed.kind
        super().__init__(str(failed))

    @property
    def reason(self) -> str:
        return f"agent_{self.kind}"

    @property
    def cut(self) -> str:
        """The episode's cut, as Trajectory.cut_short takes it: the reason, then what."""
        return f"{self.reason}: {self}"


class AgentClient(ClosedOnExit):
    """Runs episodes on one agent service (its URL: a headless Service's name, one
    replica per address). At most `max_concurrent_episodes` at once; past it, an episode
    waits for one to end (that wait is not part of its deadline: the agent has not
    started it). Used on one event loop: the rollout engine's."""

    def __init__(
        self,
        url: str,
        *,
        name: str = "agent",
        max_concurrent_episodes: int = 16,
        grace_seconds: float = GRACE_SECONDS,
        resolve: Resolve = resolve_replicas,
    ) -> None:
        if max_concurrent_episodes < 1:
            raise ValueError(
                f"max_concurrent_episodes must be at least 1, got {max_concurrent_episodes}"
            )
        self.name, self.grace_seconds = name, grace_seconds
        self.replicas = EnvironmentReplicas(url, resolve=resolve, service=f"agent {name!r}")
        self._slots = asyncio.Semaphore(max_concurrent_episodes)

    @classmethod
    def of(cls, agent: AgentConfig, url: str | None = None, *, engines: int = 1) -> AgentClient:
        """The client of `agents[]` entry `agent`, for one of `engines` rollout engines:
        its share of the agent's episodes. `url`: where a local run serves an agent given
        by its function (`serve`)."""
        where = url or agent.url
        if where is None:
            raise ValueError(
                f"agents[{agent.name}] has no url: an agent given by its function (serve) "
                "needs the URL it is served at"
            )
        share = max(1, math.ceil(agent.max_concurrent_episodes / engines))
        return cls(where, name=agent.name, max_concurrent_episodes=share)

    async def run(self, request: EpisodeRequest) -> EpisodeResult:
        """The episode, run by the agent to its result; AgentEpisodeFailed otherwise."""
        async with self._slots:
            body_of = _bodies(request)

            async def send(replica: EnvironmentClient, left: float) -> EpisodeResult:
                return await replica.call(
                    "episode", "POST", EPISODES_PATH, EpisodeResult, body_of(), left
                )

            try:
                async with self.replicas.session() as placed:
                    return await placed.first_call(
                        send, request.deadline_seconds + self.grace_seconds
                    )
            except EnvironmentCallFailed as failed:
                raise AgentEpisodeFailed(failed) from failed

    async def health(self, *, timeout: float = 10.0) -> Health:
        """The service's health check (the name it serves and its episodes running)."""
        async with self.replicas.session() as placed:
            try:
                return await placed.health(timeout=timeout)
            except EnvironmentCallFailed as failed:
                raise AgentEpisodeFailed(failed) from failed

    async def aclose(self) -> None:
        await self.replicas.aclose()


def _bodies(request: EpisodeRequest) -> Callable[[], dict[str, Any]]:
    """The request's body for each try: the first has the episode's deadline, a later one
    what is left of it (a replica that refused it, or waiting for room, took some)."""
    first_sent: list[float] = []

    def body() -> dict[str, Any]:
        now = time.monotonic()
        first_sent[:] = first_sent or [now]
        left = max(request.deadline_seconds - (now - first_sent[0]), 0.001)
        return request.model_copy(update={"deadline_seconds": left}).model_dump(mode="json")

    return body
