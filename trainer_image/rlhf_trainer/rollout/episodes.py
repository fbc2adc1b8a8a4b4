"""Multi-turn episodes: the policy's turns and an environment's answers, token for token.

    start(row) -> prompt ids ─▶ generate a turn ─▶ parse its tool calls ─▶ step
        ▲                                                                     │
        └──── the environment's messages as ids (ChatRenderer) ◀── not done ─┘
    done ─▶ score ─▶ a Rollout whose loss mask is 1 on the sampled turns only

The trainer owns the tokens (trajectory.py): every turn is the engine's ids as sampled,
with their log-probs; what the environment says is appended through the chat template,
never by re-tokenising the conversation. Limits end an episode early: `maxTurns`, the
token budget, and deadlines per environment call, per turn and per episode. An
environment that fails or breaks the protocol ends it too, and so does a chat template
or tokenizer that fails on its messages (`template_error`: an environment's role the
template refuses). Such an episode is "cut", and its reason counted. What it is
trained on is its reason's policy (multiTurn.cuts): masked (its loss mask all 0, its
score 0), or trained on with the policy's score. An environment's per-turn rewards
(Step.reward) go with the episode, at each turn's last sampled token (TurnReward). The
session is always closed.

Sessions spread over the environment's replicas (rlhf_env.replicas). One whose replica
dies (unreachable, not an error the replica sent) starts again from its row on another
replica, counted in Episode.restarts, within the episode's deadline.

A job may declare several environments: each data row's episode runs in the one its
`environment` column names, else in multiTurn.environment (EpisodeRunners), one runner
and one set of replicas per environment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlhf_env.client import EnvironmentCallFailed, EnvironmentClient
from rlhf_env.replicas import EnvironmentReplicas
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.agentic import (
    ENVIRONMENT_COLUMN,
    EnvironmentConfig,
    MultiTurnConfig,
    ObservationTruncation,
    row_environment,
)
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.cuts import CutPolicies
from rlhf_trainer.rollout.chat_template import ChatRenderer, RenderFailed, job_template
from rlhf_trainer.rollout.episode_progress import EpisodeProgress
from rlhf_trainer.rollout.trajectory import (
    ToolCallParser,
    ToolParseFailed,
    Trajectory,
    TrajectoryLimits,
    limit_before_next_turn,
)

log = logging.getLogger(__name__)

# (prompt ids so far, most tokens to sample) -> one turn, as the engine sampled it
GenerateTurn = Callable[[list[int], int], Awaitable[Rollout]]

CLOSE_SECONDS = 10.0  # closing a session: best effort, after the episode's result is known
ENVIRONMENT_WAIT_SECONDS = 600.0  # for an environment to answer at the start (image pulls)
HEALTH_CALL_SECONDS = 10.0
HEALTH_POLL_SECONDS = 2.0
MAX_SESSION_RESTARTS = 2  # an episode whose replica died starts again elsewhere, this often


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_tokens: int  # the episode's budget: prompt, turns and tool results
    turn_tokens: int  # one turn samples at most this many (data.maxResponseLength)
    call_seconds: float  # each environment call
    turn_seconds: float  # each turn's generation
    episode_seconds: float
    observation_tokens: int | None = None  # each environment message's content, at most
    observation_truncation: ObservationTruncation = "tail"  # the part of it cut
    cuts: CutPolicies = field(default_factory=CutPolicies)  # what a cut of each reason does

    @classmethod
    def of(cls, config: JobConfig) -> EpisodeLimits:
        multi_turn = config.multi_turn
        assert multi_turn is not None, "generation.multiTurn is unset"
        return cls(
            max_turns=multi_turn.max_turns,
            max_tokens=multi_turn.max_tokens,
            turn_tokens=config.data.max_response_length,
            call_seconds=multi_turn.tool_call_timeout_seconds,
            turn_seconds=multi_turn.turn_timeout_seconds,
            episode_seconds=multi_turn.episode_timeout_seconds,
            observation_tokens=multi_turn.max_observation_tokens,
            observation_truncation=multi_turn.observation_truncation,
            cuts=multi_turn.cuts,
        )


class EnvironmentUnreachable(RuntimeError):
    pass


def check_environment(
    environment: EnvironmentConfig, wait_seconds: float = ENVIRONMENT_WAIT_SECONDS
) -> None:
    """Wait until the environment answers its health check, or fail naming it (the driver
    asks before any role starts, rather than every episode failing later). It may still
    be starting: the operator starts its pods beside the Ray cluster's."""
    url = environment.url
    if url is None:
        raise EnvironmentUnreachable(
            f"environment {environment.name!r} has no url: an environment given by its class "
            "(serve) runs only in a local run (rlhfjob train --local); in a cluster, give url"
        )

    async def healthy() -> None:
        deadline = time.monotonic() + wait_seconds
        async with EnvironmentClient(url) as client:
            while True:
                left = deadline - time.monotonic()
                try:
                    await client.health(timeout=max(min(HEALTH_CALL_SECONDS, left), 0.1))
                    return
                except EnvironmentCallFailed:
                    if left <= HEALTH_POLL_SECONDS:
                        raise
                await asyncio.sleep(HEALTH_POLL_SECONDS)

    try:
        asyncio.run(healthy())
    except EnvironmentCallFailed as failed:
        raise EnvironmentUnreachable(
            f"environment {environment.name!r} did not answer within {wait_seconds:g} s: {failed}"
        ) from failed


def environments_used(config: JobConfig, rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The environments the rows' episodes run in, in declared order (rows checked at
    load: data.prompts.load_prompts)."""
    multi_turn, declared = config.multi_turn, [e.name for e in config.environments]
    assert multi_turn is not None, "generation.multiTurn is unset"
    used = {row_environment(row, multi_turn, declared) for row in rows}
    return [name for name in declared if name in used]


def check_episodes(
    config: JobConfig,
    rows: Iterable[Mapping[str, Any]],
    wait_seconds: float = ENVIRONMENT_WAIT_SECONDS,
) -> None:
    """What episodes need, checked by the driver before any role starts: the chat
    template (chatTemplateFrom's file), and every environment the rows run in, each
    answering its health check (check_environment)."""
    assert config.multi_turn is not None, "generation.multiTurn is unset"
    job_template(config.multi_turn)
    for name in environments_used(config, rows):
        check_environment(config.environment(name), wait_seconds)


class EpisodeRunner:
    """Runs episodes of one environment, for one rollout engine's turns. Every method
    runs on the engine's event loop (the HTTP client belongs to it)."""

    def __init__(
        self,
        replicas: EnvironmentReplicas,
        renderer: ChatRenderer,
        tool_parser: str,
        limits: EpisodeLimits,
        environment: str = "",  # its name, on its episodes (Episode.environment)
    ) -> None:
        self.replicas = replicas
        self.renderer = renderer
        self.tool_parser = tool_parser
        self.limits = limits
        self.environment = environment
        # A parser name vLLM does not know, or one the tokenizer cannot serve, fails the
        # job here, once, rather than every episode later.
        ToolCallParser(tool_parser, renderer.tokenizer, [])

    async def run(self, row: dict[str, Any], generate: GenerateTurn, version: int) -> Rollout:
        """One episode of `row`, to its end or its cut (never raises for the
        environment's failures or the limits: they are the episode's `cut`). `version`:
        the engine's policy version now, the label of an episode cut before any turn.
        A replica that dies under it (its connection refused or broken) is left, and
        the episode starts again on another, at most MAX_SESSION_RESTARTS times."""
        episode = EpisodeProgress.opening(self.renderer, version)
        lost: list[str] = []  # the replicas that died under it
        try:
            async with asyncio.timeout(self.limits.episode_seconds):
                while True:
                    try:
                        await self._play_on_a_replica(row, generate, episode, lost)
                        break
                    except EnvironmentCallFailed as failed:
                        if not await self._restartable(failed, lost):
                            raise
                        log.warning("%s: the episode starts again on another replica", failed)
                        episode = EpisodeProgress.opening(
                            self.renderer, version, restarts=len(lost)
                        )
        except TimeoutError:
            episode.trajectory.cut_short("episode_timeout")
        except EnvironmentCallFailed as failed:
            episode.trajectory.cut_short(f"environment_{failed.kind}: {failed}")
        except RenderFailed as failed:  # the template refused what the episode holds
            episode.trajectory.cut_short(_reason("template_error", failed))
        except ToolParseFailed as failed:
            episode.trajectory.cut_short(_reason("tool_parser_error", failed))
        return episode.rollout(self.limits.cuts, self.environment)

    async def _play_on_a_replica(
        self, row: dict[str, Any], generate: GenerateTurn, episode: EpisodeProgress, lost: list[str]
    ) -> None:
        """Play the episode on the replica with the fewest sessions, outside `lost`; a
        replica that cannot be reached is marked down and added to `lost`."""
        async with self.replicas.session(avoid=lost) as environment:
            try:
                await self._play(environment, row, generate, episode)
            except EnvironmentCallFailed as failed:
                if failed.unreachable:
                    self.replicas.mark_down(environment.url)
                    lost.append(environment.url)
                raise
            finally:
                if episode.session is not None:
                    await self._close(environment, episode.session)

    async def _restartable(self, failed: EnvironmentCallFailed, lost: list[str]) -> bool:
        return (
            failed.unreachable
            and len(lost) <= MAX_SESSION_RESTARTS
            and await self.replicas.others(lost)
        )

    async def _play(
        self,
        environment: EnvironmentClient,
        row: dict[str, Any],
        generate: GenerateTurn,
        episode: EpisodeProgress,
    ) -> None:
        limits, renderer = self.limits, self.renderer
        with episode.timed("start"):
            started = await environment.start(row, timeout=limits.call_seconds)
        episode.session = started.session
        prompt = renderer.prompt_ids(started.messages, started.tools)
        # A prompt over the budget is kept only up to it: the row is never wider.
        trajectory = episode.trajectory = Trajectory(prompt_ids=prompt[: limits.max_tokens])
        parser = ToolCallParser(self.tool_parser, renderer.tokenizer, started.tools)
        while True:
            room = limits.max_tokens - len(trajectory.token_ids)
            if room <= 0:  # the environment's last messages filled it: they go with the cut
                return trajectory.cut_short("token_budget")
            try:
                with episode.timed("turn"):
                    async with asyncio.timeout(limits.turn_seconds):
                        turn = await generate(trajectory.token_ids, min(limits.turn_tokens, room))
            except TimeoutError:
                return trajectory.cut_short("turn_timeout")
            message = parser.parse(
                renderer.assistant_text(turn.response_token_ids), trajectory.turns
            )
            episode.add_turn(turn, len(message.tool_calls))
            if not turn.finished and room <= limits.turn_tokens:
                return trajectory.cut_short("token_budget")  # the budget ended the turn
            with episode.timed("step", tool_calls=len(message.tool_calls)):
                stepped = await environment.step(
                    started.session, message, timeout=limits.call_seconds
                )
            episode.add_turn_reward(stepped.reward)
            if stepped.done:
                with episode.timed("score"):
                    episode.score = await environment.score(
                        started.session, timeout=limits.call_seconds
                    )
                return None
            reason = limit_before_next_turn(
                trajectory, TrajectoryLimits(limits.max_turns, limits.max_tokens)
            )
            if reason is not None:
                return trajectory.cut_short(reason)
            answers = renderer.bounded(
                stepped.messages, limits.observation_tokens, limits.observation_truncation
            )
            closed = renderer.closes(turn.response_token_ids)
            trajectory.add_observed(renderer.observation_ids(answers, closed=closed))

    async def _close(self, environment: EnvironmentClient, session: str) -> None:
        """Close the session, whatever happened to the episode; a failure is logged,
        naming the session, never raised over the episode's result. (A session left open
        is ended by the server once idle: sessionIdleSeconds.)"""
        try:
            await asyncio.shield(environment.close(session, timeout=CLOSE_SECONDS))
        except (EnvironmentCallFailed, TimeoutError) as failed:
            log.warning("session %s was not closed: %s", session, failed)


class EpisodeRunners:
    """A runner per environment, and the one each data row's episode runs in: its
    `environment` column's, else multiTurn.environment's. They share the renderer, the
    tool parser and the limits; each has its own replicas."""

    def __init__(
        self,
        runners: Mapping[str, EpisodeRunner],
        renderer: ChatRenderer,
        multi_turn: MultiTurnConfig,
    ) -> None:
        self.runners, self.renderer, self.multi_turn = dict(runners), renderer, multi_turn

    async def run(self, row: dict[str, Any], generate: GenerateTurn, version: int) -> Rollout:
        """EpisodeRunner.run in the row's environment, which is given the row without
        the column that chose it. (The driver checked every row at load.)"""
        runner = self.runners[row_environment(row, self.multi_turn, list(self.runners))]
        given = {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN}
        return await runner.run(given, generate, version)

    async def aclose(self) -> None:
        for runner in self.runners.values():
            await runner.replicas.aclose()


def _reason(kind: str, failed: Exception, length: int = 300) -> str:
    """A cut's reason: its kind, counted (EpisodeStats.cuts), then what failed."""
    text = str(failed)
    return f"{kind}: {text if len(text) <= length else text[: length - 3] + '...'}"
