"""Episodes of an agent that owns its loop (generation.agent), run on one rollout engine:

    open an episode on the engine's gateway (a fresh key, the spec's limits)
      -> POST /episodes to the agent (agent_client): the row, the gateway's base_url, the key
      -> the agent calls the gateway until it is done, and answers with its reward
      -> close the episode: every call's token-exact record -> merged into samples

One episode gives one or more samples (gateway.merge): calls that extend each other make
one trajectory, the others a sample each, all sharing the episode's reward (the k-th from
the last times callDiscount**k). An episode the agent did not end (it failed, hung, or
its pod died: AgentEpisodeFailed) or that the gateway cut (a limit) is cut, and the
reason is kept in each sample's Episode.cut: a limit's policy (generation.agent.cuts) may
train it with a score, every other cut is masked. Every method runs on the engine's
event loop.

The loop takes one Rollout per data row: the sample holding the episode's last call (the
one the reward judges), carrying the episode's other samples, the latest first up to
maxSamplesPerEpisode in all (`Rollout.others`; algo.row_samples spreads them out). The
earlier ones are left out, counted (`EpisodeTally`, rlhf_agent_samples_left_out_total);
so are a masked episode's others, which teach nothing. An episode without a call is cut
(NO_CALLS), masked.

The reward: the agent's, with models.reward `environment: true` (an agent that returns
none is cut, UNJUDGED); otherwise the job's reward judges the row's sample, as it does
any rollout, and what the agent returned is not used.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, replace
from typing import Any

from rlhf_env.agent_protocol import EpisodeRequest
from rlhf_trainer.algo.experience import Episode, EpisodeSample, Rollout, masked_placeholder
from rlhf_trainer.api.agents import SERVED_MODEL, AgentEpisodes
from rlhf_trainer.gateway.host import GatewayHost
from rlhf_trainer.gateway.merge import episode_rollouts, latest_first, merge_calls, sample_shares
from rlhf_trainer.gateway.records import CallLimits, EpisodeRecords
from rlhf_trainer.gateway.server import Gateway
from rlhf_trainer.rollout.agent_client import AgentClient, AgentEpisodeFailed
from rlhf_trainer.rollout.agent_shared import EpisodeTally, gateway_address
from rlhf_trainer.rollout.engine import OnFinished

# The agent returned no reward, and the job's reward is the agent's (environment: true):
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
    latest: list[int]  # the samples' indices, the one holding the last call first
    shares: list[float]  # (len(rollouts),) each one's share of the reward (merge)
    trains_cut: bool = False  # its cut's policy trains it (generation.agent.cuts)

    @classmethod
    def of(
        cls,
        records: EpisodeRecords,
        score: float,
        discount: float,
        cut: str | None,
        trains_cut: bool = False,
    ) -> AgentEpisode:
        """The episode of `records`, its samples sharing `score` (the agent's reward, or
        a trained cut's policy score)."""
        samples = merge_calls(records.calls)
        rollouts = episode_rollouts(records.calls, score, discount, cut, trains_cut)
        return cls(rollouts, records, cut, latest_first(samples),
                   sample_shares(samples, discount), trains_cut)  # fmt: skip

    def kept(self, max_samples: int) -> list[int]:
        """The samples the loop takes, the last call's first: the latest `max_samples`,
        or only that one when the episode is masked (its others would teach nothing)."""
        masked = self.cut is not None and not self.trains_cut
        return self.latest[: 1 if masked else max_samples]

    def trained(self, version: int, max_samples: int) -> Rollout:
        """The episode's row for the loop: the sample holding its last call, carrying the
        others kept (earliest first). An episode without one is a masked placeholder, cut
        (its own reason, or NO_CALLS), labelled with `version` (the engine's now)."""
        kept = self.kept(max_samples)
        if not kept:
            # One token so that it packs, as a multi-turn episode cut before its first turn.
            episode = Episode(score=0.0, turns=0, tool_calls=0, version_span=0,
                              cut=self.cut or NO_CALLS)  # fmt: skip
            return masked_placeholder(version, episode)
        own, *others = kept
        shared = (EpisodeSample(self.rollouts[i], self.shares[i]) for i in reversed(others))
        return replace(self.rollouts[own], others=tuple(shared))

    def tally(self, max_samples: int) -> EpisodeTally:
        records = self.records
        cut = self.cut if self.latest else self.cut or NO_CALLS
        left_out = len(self.rollouts) - len(self.kept(max_samples))
        return EpisodeTally(
            cut, len(records.calls), dict(records.refusals),
            records.prompt_tokens, records.sampled_tokens, left_out,
        )  # fmt: skip


class AgentEpisodeRunner:
    """Runs generation.agent's episodes on `gateway` (this engine's), served at `base_url`
    (as the agent reaches it: http://<this pod>:<GATEWAY_PORT>/v1)."""

    def __init__(
        self,
        gateway: Gateway,
        base_url: str,
        agent: AgentClient,
        settings: AgentEpisodes,
        job_judges: bool = False,
    ) -> None:
        self.gateway, self.base_url, self.agent, self.settings = gateway, base_url, agent, settings
        # The job's reward (a function, a service, a model) judges each episode's row,
        # not the agent (models.reward environment: true).
        self.job_judges = job_judges
        self.tallies: list[EpisodeTally] = []  # closed since the driver last drained them

    async def trained_samples(
        self, rows: list[dict[str, Any]], name: str, version: int, on_finished: OnFinished | None
    ) -> list[Rollout]:
        """An episode per row, all at once, each giving its row's Rollout (its samples:
        AgentEpisode.trained); episodes are named `<name>-<i>`, and `on_finished(i,
        sample)` told of each as it ends. `version`: the engine's now, the label of an
        episode without a call."""
        max_samples = self.settings.max_samples_per_episode

        async def episode(index: int, row: dict[str, Any]) -> Rollout:
            ended = await self.run(row, f"{name}-{index}")
            self.tallies.append(ended.tally(max_samples))
            sample = ended.trained(version, max_samples)
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
        unjudged = reward is None and not self.job_judges
        cut = records.cut or failed or (UNJUDGED if unjudged else None)
        policy = settings.cuts.of(cut) if cut is not None else None
        trains_cut = policy is not None and policy.trains
        # A reward the job's judges: the agent's is a placeholder (Scorer ignores it).
        score = policy.reward if policy is not None else reward or 0.0
        return AgentEpisode.of(records, score, settings.call_discount, cut, trains_cut)


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
    base_url, job_judges = f"http://{host}:{served}/v1", not worker.config.models.reward.environment
    return AgentEpisodeRunner(worker.gateway, base_url, client, settings, job_judges)
