"""A run's parts, built once and closed once.

`open_parts` builds every object a run holds between its steps, in the order they
depend on each other: what fails without Ray first (the plan, the inputs, the output
and the environment checked), then the queue, the role groups, the weight transfer,
the engines' membership and the scorer. Each close is registered on one ExitStack as
its object is built, so they run in reverse order, and every one runs even when one
before it raises: a failing scorer stop or trace write leaves no actor or placement
group behind. The trainers take the parts; they build nothing and close nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_trainer.api.agentic import row_environment
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import PlacementPlan, plan_placement
from rlhf_trainer.cluster.engine_stats import EngineStatsPoller
from rlhf_trainer.cluster.queue import close_queue, spawn_queue
from rlhf_trainer.cluster.rank_host import WorkerPath
from rlhf_trainer.cluster.role_groups import WORKERS, RoleGroups, WorkerSpec
from rlhf_trainer.data.prompts import (
    CheckRow,
    Prompt,
    PromptStream,
    load_prompts,
    prompt_tokenizer,
)
from rlhf_trainer.data.tasks import RewardFunction, check_reward_arguments, reward_function
from rlhf_trainer.loop.membership import EngineMembership, Replacement
from rlhf_trainer.loop.rewards import Scorer, Tokens
from rlhf_trainer.loop.scores_ahead import scores_ahead
from rlhf_trainer.loop.weights import WeightSync
from rlhf_trainer.models import load_tokenizer
from rlhf_trainer.roles.export_files import check_export
from rlhf_trainer.rollout.agent_client import AgentClient, AgentEpisodeFailed
from rlhf_trainer.rollout.episodes import (
    ENVIRONMENT_WAIT_SECONDS,
    HEALTH_CALL_SECONDS,
    HEALTH_POLL_SECONDS,
    check_episodes,
)
from rlhf_trainer.rollout.queue import admission_limit, remembered_uids
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.timeline import Timeline

log = logging.getLogger(__name__)

# By name, as the roles' workers (cluster.role_groups.WORKERS): vLLM is its process's alone.
STREAMING_ROLLOUT = WorkerPath(
    "rlhf_trainer.rollout.streaming", "StreamingRollout", needs_process_group=False
)


@dataclass(frozen=True)
class Inputs:
    """What the run reads before any role starts: the tokenizer's part the driver
    needs, the prompts, the held-out ones, and a rule-based reward."""

    tokens: Tokens
    prompts: PromptStream
    held_out: list[Prompt]
    rule: RewardFunction | None


@dataclass
class RunParts:
    """What a run holds between steps: built once by open_parts, closed only by it."""

    config: JobConfig
    plan: PlacementPlan
    metrics: TrainerMetrics
    timeline: Timeline
    tokens: Tokens
    prompts: PromptStream
    held_out: list[Prompt]
    groups: RoleGroups
    weights: WeightSync  # open
    engines: EngineMembership
    scorer: Scorer
    queue: Any  # fully async's SampleQueue actor (None in synchronous mode)


@contextmanager
def open_parts(
    config: JobConfig,
    job: str,
    metrics: TrainerMetrics | None = None,
    trace: Path | None = None,
    reward_files: Path | None = None,
) -> Iterator[RunParts]:
    """The job's parts, its roles started on the connected Ray cluster; on leaving, each
    is closed (the trace written, every role and the queue ended), all of them even
    when one close fails."""
    with ExitStack() as close:
        plan = plan_placement(config)
        inputs = load_inputs(config, reward_files)  # fails in seconds, before Ray
        metrics = metrics or TrainerMetrics(pools=[p.name for p in plan.pools])
        timeline = Timeline(listeners=[metrics.observe_span])
        if trace is not None:
            close.callback(timeline.write_chrome_trace, trace)
        queue = sample_queue(config)
        if queue is not None:
            close.callback(close_queue, queue)
        rollout = rollout_worker(config, queue)
        started = time.time()
        groups = RoleGroups.start(plan, config, job, {Role.ROLLOUT: rollout})
        close.callback(groups.shutdown)
        log.info("roles started in %.1f s", time.time() - started)
        poller = EngineStatsPoller(lambda: groups[Role.ROLLOUT], metrics.engines.observe)
        close.callback(poller.start().stop)
        weights = WeightSync(groups, config.trainer.weight_sync_timeout_seconds)
        weights.open()
        engines = EngineMembership(
            groups, weights, plan, rollout, Replacement.of(config),
            config.generation.max_engine_restarts, metrics, timeline,
        )  # fmt: skip
        reward = config.models.reward
        ahead = scores_ahead(config)
        scorer = close.enter_context(
            Scorer.open(reward, inputs.rule, groups, inputs.tokens, timeline, ahead)
        )
        yield RunParts(
            config, plan, metrics, timeline, inputs.tokens, inputs.prompts, inputs.held_out,
            groups, weights, engines, scorer, queue,
        )  # fmt: skip


def load_inputs(config: JobConfig, reward_files: Path | None) -> Inputs:
    """The tokenizer, the prompts and the reward rule, loaded and checked against each
    other; an unwritable output or an environment out of reach fails here too."""
    tokenizer = load_tokenizer(config.models.actor)
    tokenize = prompt_tokenizer(tokenizer, config.data.chat_template)
    check_row = row_check(config)
    prompts = PromptStream.load(config.data, config.trainer.seed, tokenize, check_row)
    held_out = (
        load_prompts(config.data, config.trainer.seed, tokenize, "eval", check_row)[0]
        if config.data.eval is not None
        else []
    )
    check_export(config)  # an export that would fail at the end fails now
    if config.multi_turn is not None:  # so does an environment out of reach, or the template
        check_episodes(config, (p.fields for p in [*prompts.prompts, *held_out]))
    check_agent(config)  # and an agent's
    rule = reward_function(config.models.reward, reward_files)
    if rule is not None:
        check_reward_arguments(rule, prompts.prompts[0].fields, "data.train")
        if held_out:
            check_reward_arguments(rule, held_out[0].fields, "data.eval")
    tokens = Tokens(
        lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=False)),
        int(tokenizer.pad_token_id),
    )
    return Inputs(tokens, prompts, held_out, rule)


class AgentUnreachable(RuntimeError):
    pass


def check_agent(config: JobConfig, wait_seconds: float = ENVIRONMENT_WAIT_SECONDS) -> None:
    """generation.agent's agent answers its health check, waited for as an environment
    is (rollout.episodes.check_environment), or the run fails naming it before any role
    starts. Nothing to check without generation.agent."""
    settings = config.generation.agent
    if settings is None:
        return
    agent = config.agent(settings.agent)
    if agent.url is None:  # the operator gives a served agent's url; a local run serves it
        raise AgentUnreachable(
            f"agent {agent.name!r} has no url: an agent given by its function (serve) is "
            "served by the operator in a cluster, or by a local run (rlhfjob train --local)"
        )

    async def healthy() -> None:
        deadline = time.monotonic() + wait_seconds
        async with AgentClient.of(agent) as client:
            while True:
                left = deadline - time.monotonic()
                try:
                    await client.health(timeout=max(min(HEALTH_CALL_SECONDS, left), 0.1))
                    return
                except AgentEpisodeFailed:
                    if left <= HEALTH_POLL_SECONDS:
                        raise
                await asyncio.sleep(HEALTH_POLL_SECONDS)

    try:
        asyncio.run(healthy())
    except AgentEpisodeFailed as failed:
        raise AgentUnreachable(
            f"agent {agent.name!r} did not answer within {wait_seconds:g} s: {failed}"
        ) from failed


def row_check(config: JobConfig) -> CheckRow | None:
    """With multiTurn, each data row must pick a declared environment (its column, or
    the default): checked at load, naming the row, not when its episode runs."""
    multi_turn, declared = config.multi_turn, [e.name for e in config.environments]
    if multi_turn is None:
        return None
    return lambda row: row_environment(row, multi_turn, declared)


def sample_queue(config: JobConfig) -> Any:
    """Fully async's sample queue (None in synchronous mode), remembering as many uids as
    this job's admissions can have outstanding."""
    if config.async_ is None:
        return None
    group = config.generation.samples_per_prompt
    limit = admission_limit(config.trainer.batch_size, config.async_.trigger_parameter_sync_step,
                            config.async_.staleness_threshold)  # fmt: skip
    return spawn_queue(group, remembered_uids(limit, group), keep_arrivals=scores_ahead(config))


def rollout_worker(config: JobConfig, queue: Any | None) -> WorkerSpec:
    """The rollout engines' worker: the one place it is named. Fully async's streams
    its samples into the queue."""
    if queue is None:
        return WorkerSpec(WORKERS[Role.ROLLOUT], (config,))
    return WorkerSpec(STREAMING_ROLLOUT, (config, queue))
