"""Episodes of an agent that owns its loop (generation.agent), run on one rollout engine:

    open an episode on the engine's gateway (a fresh key, the spec's limits)
      -> POST /episodes to the agent (agent_client): the row, the gateway's base_url, the key
      -> the agent calls the gateway until it is done, and answers with its reward
      -> close the episode: every call's token-exact record -> merged into samples

One episode gives one or more samples (gateway.merge): calls that extend each other make
one trajectory, the others a sample each, all sharing the episode's reward. An episode
the agent did not end (it failed, hung, or its pod died: AgentEpisodeFailed) or that the
gateway cut (a limit) is cut: its samples are not trained on, and the reason is kept in
each sample's Episode.cut. Every method runs on the engine's event loop.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from rlhf_env.agent_protocol import EpisodeRequest
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.agents import SERVED_MODEL, AgentEpisodes
from rlhf_trainer.gateway.merge import episode_rollouts
from rlhf_trainer.gateway.records import CallLimits, EpisodeRecords
from rlhf_trainer.gateway.server import Gateway
from rlhf_trainer.rollout.agent_client import AgentClient, AgentEpisodeFailed

# The agent returned no reward: the job's reward must judge its transcript. Not wired yet:
# such an episode is cut under this reason rather than trained on with a made-up reward.
UNJUDGED = "agent_unjudged"


@dataclass(frozen=True)
class AgentEpisode:
    """One episode as the trainer takes it: its samples and its gateway records."""

    rollouts: list[Rollout]  # in the order their samples started (gateway.merge)
    records: EpisodeRecords  # for rlhf_agent_* (TrainerMetrics.agents.count_episode)
    cut: str | None


class AgentEpisodeRunner:
    """Runs generation.agent's episodes on `gateway` (this engine's), served at `base_url`
    (as the agent reaches it: http://<this pod>:<GATEWAY_PORT>/v1)."""

    def __init__(
        self, gateway: Gateway, base_url: str, agent: AgentClient, settings: AgentEpisodes
    ) -> None:
        self.gateway, self.base_url, self.agent, self.settings = gateway, base_url, agent, settings

    async def run(self, row: dict[str, Any], episode_id: str) -> AgentEpisode:
        key = secrets.token_urlsafe(24)  # the agent's only credential for its calls
        settings = self.settings
        self.gateway.open_episode(key, CallLimits.of(settings))
        request = EpisodeRequest(
            episode_id=episode_id,
            task=row,
            base_url=self.base_url,
            api_key=key,
            model=SERVED_MODEL,
            deadline_seconds=settings.episode_timeout_seconds,
        )
        failed: str | None = None
        reward: float | None = None
        try:
            reward = (await self.agent.run(request)).reward
        except AgentEpisodeFailed as failure:
            failed = failure.cut
        finally:
            records = await self.gateway.close_episode(key)  # aborts calls still in flight
        cut = records.cut or failed or (UNJUDGED if reward is None else None)
        rollouts = episode_rollouts(records.calls, reward or 0.0, settings.call_discount, cut)
        return AgentEpisode(rollouts, records, cut)
