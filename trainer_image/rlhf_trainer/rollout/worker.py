"""The rollout role's workers: one vLLM engine per rank, which takes the actor's
weights through vLLM's weight-transfer API (`transfer_engines`; the actor's side
calls the methods named as vLLM's). `RolloutWorker` generates a batch at a time
(synchronous PPO), handing each sample over as it finishes; `streaming.StreamingRollout`
streams (fully async)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from rlhf_env.replicas import EnvironmentReplicas
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import EvalGeneration, GenerationConfig
from rlhf_trainer.gateway.host import GatewayHost
from rlhf_trainer.models import chat_tokenizer, model_path
from rlhf_trainer.rollout.agent_episodes import agent_runner
from rlhf_trainer.rollout.agent_shared import EpisodeTally
from rlhf_trainer.rollout.chat_template import job_template
from rlhf_trainer.rollout.engine import EngineOptions, OnFinished, RolloutEngine
from rlhf_trainer.rollout.engine_death import EngineDied
from rlhf_trainer.rollout.episodes import EpisodeLimits, EpisodeRunner, EpisodeRunners
from rlhf_trainer.rollout.trajectory import ChatRenderer
from rlhf_trainer.rollout.transfer_memory import Relay
from rlhf_trainer.rollout.weight_sync import HOST_TRANSFER, AdapterFiles, Bucket, EngineTransfer
from rlhf_trainer.telemetry.engine_stats import EngineStats, read_engine_stats
from rlhf_trainer.worker import RankInfo, Worker, derive_seed

log = logging.getLogger(__name__)
T = TypeVar("T")

# The exit status of a rollout rank whose vLLM engine died (EX_SOFTWARE).
ENGINE_DIED_EXIT = 70


def end_rank(died: EngineDied) -> None:
    """End this rollout rank's process: its vLLM engine died. The driver then sees the
    rank lost, as it sees one whose node is gone, and replaces it in its bundle with a
    new engine that the next push gives the current weights (on every backend: nothing
    of the dead engine is needed). Ending the process frees its GPUs for the new one."""
    log.error("%s; this rank's process ends, for the driver to replace it", died)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(ENGINE_DIED_EXIT)


class EngineWorker(GatewayHost, Worker):
    """A vLLM engine built from the spec, and the receiving end of the weight transfer:
    the four calls of vLLM's `VLLMWeightSyncClient`, made by the actor's rank 0. It
    needs no process group of its own (vLLM makes its own). With generation.agent it
    serves the agents' gateway (GatewayHost: start_gateway, open_agent_episode,
    close_agent_episode)."""

    needs_process_group = False

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.config = config
        self.engine_options = EngineOptions.of(config)
        self.engine = RolloutEngine(
            model_path(config.models.actor, config.trainer.seed),
            **asdict(self.engine_options),
            name=f"rollout rank {info.rank} (pool {info.pool})",
            on_death=end_rank,
        )
        self.relay: Relay | None = None  # host transfer, on another node than the sender
        self.episodes = episode_runner(config)  # generation.multiTurn only
        self.agents = agent_runner(self, info.world_size)  # generation.agent only

    @property
    def host_transfer(self) -> bool:
        return self.engine.transfer_backend == HOST_TRANSFER

    def weight_transfer(self) -> EngineTransfer:
        """The transfer this engine was built with (the driver hands it to the actor)."""
        return EngineTransfer(self.engine.transfer_backend, self.engine_options.workers)

    def shutdown_weight_transfer_engine(self) -> None:
        """Close this engine's side of the transfer set up before, if any: vLLM's
        engine's (`shutdown_weight_transfer_engine`), or with the host transfer the
        gloo relay (vLLM's side of it holds no connection)."""
        if not self.host_transfer:
            self.engine.shutdown_transfer()
        elif self.relay is not None:
            self.relay.close()
            self.relay = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Set up the engine's side of the transfer. With the host transfer an engine
        on another node than the sender joins its gloo group; with vLLM's, the engine
        takes `init_info` as it is."""
        if not self.host_transfer:
            self.engine.init_transfer(init_info)
            return
        if self.relay is not None:
            self.relay.close()
        self.relay = Relay.join(init_info, self.info.rank)

    def start_weight_update(self) -> None:
        """Pause (a partial rollout: requests in flight keep their tokens) and open an
        update. A paused engine stays paused until the update is done."""
        self.engine.open_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one bucket (with the host transfer, from shared memory: the sender's ring
        on its node, else this engine's ring, filled over gloo)."""
        if self.host_transfer and self.relay is not None:
            update_info = self.relay.receive(Bucket.from_dict(update_info)).to_dict()
        self.engine.load_bucket(update_info)

    def finish_weight_update(self, weight_version: int) -> None:
        """Serve the new weights as `weight_version` (and resume, if the update paused
        the engine)."""
        self.engine.close_update(weight_version)

    def load_adapter(self, files: AdapterFiles, version: int) -> None:
        """Serve the actor's new LoRA adapter as `version` (LoRA RL: the whole sync)."""
        self.engine.load_adapter(files, version)

    def abandon_weight_update(self) -> None:
        """Close an update that a failed push left open (an engine lost mid-way), not
        serving what it loaded: the engine stays paused until the next push."""
        self.engine.abandon_update()

    def evaluate(self, prompts: list[Any], step: int) -> list[Rollout]:
        """One response per prompt (token ids), or one episode per environment row
        (generation.multiTurn), sampled as generation.eval says, on the weights the
        engine has now. Beside any other requests (fully async goes on generating), but
        it holds this worker: the next weights load only after it (one version)."""
        sampling = self.config.generation.eval
        seed = derive_seed(self.config.trainer.seed, "eval", step, self.info.rank)
        if self.episodes is not None or self.agents is not None:
            return self.engine.call(self.episodes_of(prompts, f"eval-{step}", seed, sampling))

        async def answer_all() -> list[Rollout]:
            answers = (
                self.engine.generate(
                    f"eval-{step}-{i}",
                    prompt,
                    max_tokens=self.config.data.max_response_length,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    seed=seed + i,
                )
                for i, prompt in enumerate(prompts)
            )
            return list(await asyncio.gather(*answers))

        return self.engine.call(answer_all())

    async def episodes_of(
        self,
        rows: list[dict[str, Any]],
        name: str,
        seed: int,
        sampling: GenerationConfig | EvalGeneration | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[Rollout]:
        """An episode per row (generation.multiTurn), sampled as `sampling` says (the
        training sampling by default); requests are named `episode-<name>-<i>-<turn>`.
        `on_finished(i, episode)` is told of each as it ends, as `generate_batch` does.
        With generation.agent, an agent's episode per row: a row's Rollout is the sample
        holding its last call, its other samples in `Rollout.others` (the agent samples as
        it asks: `seed` and `sampling` are not its)."""
        if self.agents is not None:
            version = self.engine.policy_version
            return await self.agents.trained_samples(rows, name, version, on_finished)
        if self.episodes is None:
            raise RuntimeError("episodes need generation.multiTurn or generation.agent")
        runner, sampled = self.episodes, sampling or self.config.generation

        async def episode(index: int, row: dict[str, Any]) -> Rollout:
            turns = itertools.count()

            async def turn(prompt: list[int], max_tokens: int) -> Rollout:
                number = next(turns)
                return await self.engine.generate(
                    f"episode-{name}-{index}-{number}",
                    prompt,
                    max_tokens=max_tokens,
                    temperature=sampled.temperature,
                    top_p=sampled.top_p,
                    seed=seed + number * len(rows) + index,
                    stop_token_ids=(runner.renderer.end_of_turn_id,),
                )

            rollout = await runner.run(row, turn, self.engine.policy_version)
            if on_finished is not None:
                on_finished(index, rollout)
            return rollout

        return list(await asyncio.gather(*(episode(i, row) for i, row in enumerate(rows))))

    def engine_stats(self) -> EngineStats | None:
        """The engine's vLLM stats. Safe from any thread, at any time: it
        reads metric values in this process and never waits for the engine."""
        engine: RolloutEngine | None = getattr(self, "engine", None)  # None: being built
        return read_engine_stats() if engine is None else engine.stats()

    def drain_agent_tallies(self) -> list[EpisodeTally]:
        """The agent episodes closed since the last drain, for the driver's rlhf_agent_*."""
        agents = self.agents
        return [] if agents is None else self.engine.call(_now(agents.drain_tallies))

    def close(self) -> None:
        if self.episodes is not None:
            self.engine.call(self.episodes.aclose())
        if self.agents is not None:
            self.engine.call(self.agents.aclose())
        self.engine.shutdown()
        if self.relay is not None:
            self.relay.close()


@dataclass(frozen=True)
class BatchShard:
    """A rollout rank's part of a step's batch. Its seeds follow `index`, which part it
    is, not the rank that generates it: an engine that replaces a lost one makes the
    samples the lost one would have (`loop.membership`)."""

    index: int
    inputs: list[Any]  # prompts' token ids, or environment rows (generation.multiTurn)


class RolloutWorker(EngineWorker):
    """Synchronous PPO's rollout rank: generates the batch it is given, and hands each
    sample over as it finishes (a Ray streaming call: the driver may score the first
    ones while the engine still generates the rest)."""

    def generate(
        self, shard: BatchShard, step: int, attempt: int = 0
    ) -> Iterator[tuple[int, Rollout]]:
        """One response per prompt, as each finishes: (its place in the shard, it).
        `attempt` > 0: dynamic sampling's further rounds of the step, seeded apart from
        the first."""
        generation = self.config.generation
        return as_finished(
            lambda on_finished: self.engine.generate_batch(
                shard.inputs,
                max_tokens=self.config.data.max_response_length,
                temperature=generation.temperature,
                top_p=generation.top_p,
                seed=self.step_seed(step, attempt, shard),
                on_finished=on_finished,
            )
        )

    def run_episodes(
        self, shard: BatchShard, step: int, attempt: int = 0
    ) -> Iterator[tuple[int, Rollout]]:
        """One multi-turn episode per environment row, all at once on the engine (its
        turns batch with the other episodes' turns), as each ends, like `generate`.
        Turn t of episode i samples with the step's seed + t·len(rows) + i."""
        seed = self.step_seed(step, attempt, shard)
        name = f"{step}-{attempt}"
        return as_finished(
            lambda on_finished: self.engine.call(
                self.episodes_of(shard.inputs, name, seed, on_finished=on_finished)
            )
        )

    def step_seed(self, step: int, attempt: int, shard: BatchShard) -> int:
        """Per step, round and part of the batch: a resumed run samples what the first
        one would have, and so does an engine that replaced a lost one."""
        purpose = "generate" if attempt == 0 else f"generate-round-{attempt}"
        return derive_seed(self.config.trainer.seed, purpose, step, shard.index)


def as_finished(generate: Callable[[OnFinished], object]) -> Iterator[tuple[int, Rollout]]:
    """Runs `generate(on_finished)` on a thread of its own, and yields each (place,
    rollout) it reports finished, as it does; then raises what `generate` raised."""
    finished: queue.SimpleQueue[tuple[int, Rollout] | None] = queue.SimpleQueue()
    with ThreadPoolExecutor(1, thread_name_prefix="generate") as thread:
        generating = thread.submit(generate, lambda place, r: finished.put((place, r)))
        generating.add_done_callback(lambda _: finished.put(None))
        while (item := finished.get()) is not None:
            yield item
        generating.result()


async def _now(call: Callable[[], T]) -> T:
    """`call()` on the engine's event loop (engine.call runs coroutines there)."""
    return call()


def episode_runner(config: JobConfig) -> EpisodeRunners | None:
    """The runners of generation.multiTurn's episodes, one per environment (each row's
    picks its own); None without."""
    multi_turn = config.multi_turn
    if multi_turn is None:
        return None
    actor, template = config.models.actor, job_template(multi_turn)
    renderer = ChatRenderer(
        chat_tokenizer(actor, template),
        actor.path or "the tiny model",
        template=template,
        template_kwargs=multi_turn.chat_template_kwargs,
    )
    limits, parser = EpisodeLimits.of(config), multi_turn.tool_parser
    # One per environment with a url (sessions spread over its pods): one without is no
    # row's (the driver checked that each row's environment answers).
    runners = {
        e.name: EpisodeRunner(EnvironmentReplicas(e.url), renderer, parser, limits, e.name)
        for e in config.environments
        if e.url is not None
    }
    return EpisodeRunners(runners, renderer, multi_turn)
