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

The loop takes one sample per data row (a batch, a GRPO group), so in v1 each episode
trains exactly one: the sample holding its last call (`AgentEpisode.trained`), the one
the reward judges and, for an agent that appends to its history, its only one. Its
earlier samples that extend nothing are left out, counted (`EpisodeTally`,
rlhf_agent_samples_left_out_total). An episode without a call is cut (NO_CALLS), masked.
Agent cuts are always masked: they are not CUT_REASONS, which multiTurn.cuts sets.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_env.agent_protocol import EpisodeRequest
from rlhf_trainer.algo.experience import Episode, Rollout
from rlhf_trainer.api.agents import SERVED_MODEL, AgentEpisodes
from rlhf_trainer.gateway.host import GatewayHost
from rlhf_trainer.gateway.merge import episode_rollouts, merge_calls
from rlhf_trainer.gateway.records import CallLimits, CallRecord, EpisodeRecords
from rlhf_trainer.gateway.server import Gateway
from rlhf_trainer.rollout.agent_client import AgentClient, AgentEpisodeFailed
from rlhf_trainer.rollout.agent_shared import EpisodeTally, gateway_address
from rlhf_trainer.rollout.engine import OnFinished

# The agent returned no reward: the job's reward must judge its transcript. Not wired yet:
# such an episode is cut under this reason rather than trained on with a made-up reward.
UNJUDGED = "agent_unjudged"
# The episode made no call: nothing was sampled, nothing to train on.
NO_CALLS = "agent_no_calls"


@dataclass(frozen=True)
class AgentEpisode:
    """One episode as the trainer takes it: its samples and its gateway records."""

    rollouts: list[Rollout]  # in the order their samples started (gateway.merge)
    records: EpisodeRecords  # for rlhf_agent_* (TrainerMetrics.agents.count_episode)
    cut: str | None
    last: int | None = None  # the sample holding its last call (None: no call)

    def trained(self, version: int) -> Rollout:
        """The episode's one sample for the loop (v1): the one holding its last call. An
        episode without one is a masked placeholder, cut (its own reason, or NO_CALLS),
        labelled with `version` (the engine's now)."""
        if self.last is not None:
            return self.rollouts[self.last]
        # One token so that it packs, as a multi-turn episode cut before its first turn.
        episode = Episode(score=0.0, turns=0, tool_calls=0, version_span=0,
                          cut=self.cut or NO_CALLS)  # fmt: skip
        return Rollout([PLACEHOLDER_ID], [], [], False, version, episode=episode)

    def tally(self) -> EpisodeTally:
        records = self.records
        cut = self.cut if self.last is not None else self.cut or NO_CALLS
        return EpisodeTally(
            cut, len(records.calls), dict(records.refusals),
            records.prompt_tokens, records.sampled_tokens, max(len(self.rollouts) - 1, 0),
        )  # fmt: skip


# A masked placeholder's one prompt token: any id of the vocabulary (it is never trained).
PLACEHOLDER_ID = 0


def last_sample(calls: Sequence[CallRecord]) -> int | None:
    """The index, among gateway.merge's samples of `calls`, of the one holding the last
    call (k = 0 in merge.sample_rewards' order); None when nothing was sampled."""
    samples = merge_calls(calls)
    if not samples:
        return None
    return max(range(len(samples)), key=lambda i: (samples[i].calls[-1], i))


class AgentEpisodeRunner:
    """Runs generation.agent's episodes on `gateway` (this engine's), served at `base_url`
    (as the agent reaches it: http://<this pod>:<GATEWAY_PORT>/v1)."""

    def __init__(
        self, gateway: Gateway, base_url: str, agent: AgentClient, settings: AgentEpisodes
    ) -> None:
        self.gateway, self.base_url, self.agent, self.settings = gateway, base_url, agent, settings
        self.tallies: list[EpisodeTally] = []  # closed since the driver last drained them

    async def trained_samples(
        self, rows: list[dict[str, Any]], name: str, version: int, on_finished: OnFinished | None
    ) -> list[Rollout]:
        """An episode per row, all at once, each giving its one trained sample (v1);
        episodes are named `<name>-<i>`, and `on_finished(i, sample)` told of each as it
        ends. `version`: the engine's now, the label of an episode without a call."""

        async def episode(index: int, row: dict[str, Any]) -> Rollout:
            ended = await self.run(row, f"{name}-{index}")
            self.tallies.append(ended.tally())
            sample = ended.trained(version)
            if on_finished is not None:
                on_finished(index, sample)
            return sample

        return list(await asyncio.gather(*(episode(i, row) for i, row in enumerate(rows))))

    def drain_tallies(self) -> list[EpisodeTally]:
        drained, self.tallies = self.tallies, []
        return drained

    async def aclose(self) -> None:
        await self.agent.aclose()
        await self.gateway.stop()

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
        return AgentEpisode(rollouts, records, cut, last_sample(records.calls))


def agent_runner(worker: GatewayHost, engines: int) -> AgentEpisodeRunner | None:
    """generation.agent's episodes on `worker`'s engine, one of `engines` rollout engines
    (its share of the agent's concurrency), its gateway started; None without."""
    settings = worker.config.generation.agent
    if settings is None:
        return None
    host, port = gateway_address()
    served = worker.start_gateway(port)
    assert worker.gateway is not None
    client = AgentClient.of(worker.config.agent(settings.agent), engines=engines)
    return AgentEpisodeRunner(worker.gateway, f"http://{host}:{served}/v1", client, settings)
