"""A training run: start the roles, resume from the latest checkpoint, run the PPO
steps, checkpoint, and report progress (status, metrics, timeline)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from rlhf_trainer.algo.diagnostics import EpisodeStats
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.progress import EvalProgress, OutputProgress, TrainingProgress
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.waits import join
from rlhf_trainer.loop.evaluation import Evaluator, eval_due
from rlhf_trainer.loop.fully_async import AsyncPPOTrainer, AsyncState
from rlhf_trainer.loop.setup import open_parts
from rlhf_trainer.loop.sync import PPOTrainer, StepResult
from rlhf_trainer.roles import checkpoint
from rlhf_trainer.roles.checkpoint import TrainerState, capture_rng, restore_rng
from rlhf_trainer.rollout.agent_shared import EpisodeTally
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.progress import STEP_LOG
from rlhf_trainer.telemetry.report import Reporter

log = logging.getLogger(__name__)
step_log = logging.getLogger(STEP_LOG)  # quiet while a live bar shows the steps

TRAINED_ROLES = (Role.ACTOR, Role.CRITIC)
ASYNC_STATE = "async_state.json"  # fully async: the queue and the prompts in flight


@dataclass
class Run:
    """The driver's side of a job: what it owns between steps."""

    config: JobConfig
    trainer: PPOTrainer
    metrics: TrainerMetrics
    reporter: Reporter
    streaming: AsyncPPOTrainer | None = None  # fully-async mode
    evaluator: Evaluator | None = None  # with data.eval
    step: int = 0
    last_checkpoint: str | None = None
    last_output: OutputProgress | None = None

    @property
    def checkpoint_root(self) -> Path | None:
        """None: this job keeps no checkpoints (on a cluster, no shared volume for them)."""
        path = self.config.trainer.checkpoint.path
        return Path(path) if path is not None else None

    def start(self) -> None:
        """Continue from the latest committed checkpoint, if there is one, and start
        the rollouter in fully-async mode."""
        root = self.checkpoint_root
        latest = checkpoint.latest(root) if root is not None else None
        resumed = self.resume(latest) if latest is not None else None
        if self.streaming is not None:
            self.streaming.start(resumed)
        elif latest is not None:
            # The engines start from the initial weights.
            self.trainer.sync_weights()
        if self.evaluator is not None and self.evaluator.owed(self.step):
            self.evaluator.start(self.step)

    def checkpointed(self) -> list[tuple[Role, WorkerGroup]]:
        """The trained roles of this job (no critic with a critic-free estimator)."""
        groups = self.trainer.groups
        return [(role, group) for role in TRAINED_ROLES if (group := groups.get(role))]

    def resume(self, latest: Path) -> AsyncState | None:
        state = checkpoint.load_trainer_state(latest)
        loads = [group.run("load", str(latest / role)) for role, group in self.checkpointed()]
        join([ref for refs in loads for ref in refs])
        self.trainer.prompts.seek(state.data_epoch, state.data_position)
        restore_rng(state.rng)
        self.step = state.step
        self.trainer.policy_version = state.policy_version
        if state.kl_coef is not None:
            self.trainer.kl_coef = state.kl_coef
        if self.evaluator is not None and state.last_eval is not None:
            self.evaluator.last = state.last_eval
            self.metrics.observe_eval(state.last_eval)  # the gauges show the last one
        self.last_checkpoint = str(latest)
        log.info("resuming from %s at step %d", latest, self.step)
        if self.streaming is None:
            return None
        return AsyncState.from_json(checkpoint.load_json(latest, ASYNC_STATE))

    def save(self) -> None:
        """Write a checkpoint of everything the run needs, atomically (nothing when the
        job keeps no checkpoints)."""
        root = self.checkpoint_root
        if root is None:
            return
        staging = checkpoint.staging_dir(root, self.step)
        saves = [group.run("save", str(staging / role)) for role, group in self.checkpointed()]
        join([ref for refs in saves for ref in refs])
        if self.streaming is not None:
            # The samples not trained yet: queued, and the prompts still generating.
            checkpoint.save_json(staging, ASYNC_STATE, self.streaming.checkpoint_state().to_json())
        epoch, position = self.trainer.prompts.position()
        state = TrainerState(
            self.step,
            self.trainer.policy_version,
            epoch,
            position,
            capture_rng(),
            self.trainer.kl_coef,
            self.evaluator.last if self.evaluator else None,
        )
        checkpoint.save_trainer_state(staging, state)
        checkpoint.save_job_config(staging, self.config)
        final = checkpoint.commit(root, self.step)
        checkpoint.prune(root, self.config.trainer.checkpoint.keep)
        self.last_checkpoint = str(final)

    def export(self) -> None:
        """Write the policy to output as a Hugging Face directory: the actor's ranks gather
        it, rank 0 writes it (roles.hf_export)."""
        output = self.config.output
        assert output is not None
        started = time.time()
        adapter = output.lora == "adapter"
        actor = self.trainer.groups[Role.ACTOR]
        exports = join(actor.run("export", output.path, output.dtype, self.step, adapter))
        (done,) = [e for e in exports if e is not None]
        self.last_output = OutputProgress(
            path=str(done.directory), step=done.step, dtype=done.dtype, adapter=done.adapter
        )
        log.info("the policy of step %d is at %s (%s, written in %.1f s)", done.step,
                 done.directory, done.dtype, time.time() - started)  # fmt: skip

    def progress(self, result: StepResult | None) -> TrainingProgress:
        failed_sync = self.trainer.engines.last_failed_sync
        progress = TrainingProgress(
            step=self.step,
            total_steps=self.config.trainer.total_steps,
            policy_version=self.trainer.policy_version,
            last_checkpoint=self.last_checkpoint,
            output=self.last_output,
            eval=self.evaluator.last if self.evaluator else None,
            last_failed_sync=failed_sync.line if failed_sync else None,
        )
        if result is None:
            return progress
        critic = result.critic
        return progress.model_copy(
            update={
                "samples_per_second": self.config.samples_per_step / result.seconds,
                "reward_mean": finite_or_none(result.reward_mean),  # NaN: none scored
                "kl": result.kl,
                "kl_coef": result.kl_coef,
                "entropy": result.actor.entropy,
                "actor_grad_norm": result.actor.grad_norm,
                "critic_grad_norm": critic.grad_norm if critic else None,
                # NaN (flat returns) is no JSON number: the status leaves it out
                "explained_variance": finite_or_none(critic.explained_variance) if critic else None,
                "response_length_mean": result.responses.length_mean,
                "truncated_ratio": result.responses.truncated_ratio,
                "turns_mean": result.episodes.turns_mean if result.episodes else None,
                "cut_ratio": result.episodes.cut_ratio if result.episodes else None,
            }
        )

    def observe(self, result: StepResult) -> None:
        m = self.metrics
        m.tokens_generated.inc(result.response_tokens)
        m.samples_trained.inc(result.samples)  # an agent episode's several
        m.dropped_groups.inc(result.dropped_groups)
        m.unscored_samples.inc(result.unscored)
        m.kl.set(result.kl)
        m.kl_coef.set(result.kl_coef)
        m.observe_diagnostics(result.actor, result.critic, result.responses)
        rollout = self.trainer.groups[Role.ROLLOUT]
        if result.episodes is not None:
            m.observe_episodes(result.episodes)
            self.trainer.timeline.add_episodes(rollout.pool, result.episodes.episodes)
        if self.config.generation.agent is not None:  # the agent episodes the ranks closed
            for rank in join(rollout.run("drain_agent_tallies")):
                count_agent_episodes(m, rank)
        for evaluation in result.evaluations:
            m.observe_eval(evaluation)
        progress = self.progress(result)
        m.observe_progress(progress)
        self.reporter.report(progress, final=self.step == self.config.trainer.total_steps)

    def evaluate(self, wait: bool) -> list[EvalProgress]:
        """Start the held-out evaluation due after this step; returns those finished
        meanwhile (with `wait`, all: a checkpoint records the last one reported)."""
        if self.evaluator is None:
            return []
        done = self.evaluator.finish(wait=False)
        if eval_due(self.config, self.step):
            done += self.evaluator.start(self.step)
        return done + self.evaluator.finish(wait=wait)

    def train(
        self,
        on_step: Callable[[StepResult], None] | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> TrainingProgress:
        """Train to the last step; when `stop()` turns true, checkpoint at the end of the
        step under way and raise Interrupted."""
        total = self.config.trainer.total_steps
        every = self.config.trainer.checkpoint.every_steps
        result = None
        while self.step < total:
            self.step += 1
            result = (self.streaming or self.trainer).step(self.step)
            log_step(result, total)
            saved = self.step % every == 0 or self.step == total
            result = replace(result, evaluations=tuple(self.evaluate(wait=saved)))
            if saved:
                self.save()
            if export_due(self.config, self.step):
                self.export()
            self.observe(result)
            if on_step is not None:
                on_step(result)
            if stop() and self.step < total:
                if not saved:
                    self.save()
                # The status names the checkpoint the next attempt resumes from.
                self.reporter.report(self.progress(result), final=True)
                raise Interrupted(self.step, str(self.last_checkpoint))
        if result is None:  # resumed at the last step: nothing to train, but say so
            if export_due(self.config, self.step):  # the attempt before may have died first
                self.export()
            self.reporter.report(self.progress(None), final=True)
        return self.progress(result)


class Interrupted(Exception):
    """Training stopped on request at a step boundary, after a checkpoint of that step."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"interrupted at step {step}: checkpoint saved to {checkpoint}")
        self.step = step
        self.checkpoint = checkpoint


def export_due(config: JobConfig, step: int) -> bool:
    """Whether the policy of `step` is written to output: at the end, and every
    trainer.export.everySteps."""
    if config.output is None:
        return False
    every, total = config.trainer.export.every_steps, config.trainer.total_steps
    return step == total or (every is not None and step > 0 and step % every == 0)


def count_agent_episodes(metrics: TrainerMetrics, tallies: list[EpisodeTally]) -> None:
    """rlhf_agent_*: closed agent episodes, and their samples left out of training."""
    for t in tallies:
        metrics.agents.count_episode(t.cut, t.calls, t.refusals, t.prompt_tokens, t.sampled_tokens)
        metrics.agents.samples_left_out.inc(t.samples_left_out)


def log_step(result: StepResult, total: int) -> None:
    actor, critic, responses = result.actor, result.critic, result.responses
    parts = [
        f"step {result.step}/{total}: reward {result.reward_mean:.6f}",
        f"kl {result.kl:.4f} (coef {result.kl_coef:.6g})",
        f"policy loss {actor.policy_loss:.4f}",
        f"clipped {actor.clip_fraction:.3f}",
        f"entropy {actor.entropy:.3f}",
        f"grad norm actor {actor.grad_norm:.3f}",
    ]
    if critic is not None:
        parts += [
            f"critic {critic.grad_norm:.3f}",
            f"value loss {critic.value_loss:.4f}",
            f"explained variance {critic.explained_variance:.3f}",
        ]
    parts += [
        f"response length {responses.length_mean:.1f} (cut {responses.truncated_ratio:.2f})",
        f"importance weights capped {actor.importance_capped:.4f}",  # off-policy correction
        *([f"groups dropped {result.dropped_groups}"] if result.dropped_groups else []),
        *([f"unscored {result.unscored} (not trained on)"] if result.unscored else []),
        *([episodes_text(result.episodes)] if result.episodes else []),
        f"{result.seconds:.2f} s",
    ]
    step_log.info(", ".join(parts))


def episodes_text(episodes: EpisodeStats) -> str:
    cuts = ", ".join(f"{reason} {count}" for reason, count in sorted(episodes.cuts.items()))
    text = (
        f"turns {episodes.turns_mean:.2f}, tool calls {episodes.tool_calls_mean:.2f}, "
        f"cut {episodes.cut_ratio:.2f}{f' ({cuts})' if cuts else ''}"
    )
    if episodes.restarts:
        text += f", sessions restarted {episodes.restarts}"
    if (turn_rewards := episodes.turn_reward_mean) is not None:
        text += f", turn rewards {turn_rewards:.3f}"  # per episode
    return text


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def run_job(
    config: JobConfig,
    job: str,
    reporter: Reporter,
    metrics: TrainerMetrics | None = None,
    trace: Path | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
    reward_files: Path | None = None,
) -> TrainingProgress:
    """Train the job on the connected Ray cluster; returns the final progress. Raises
    Interrupted when `stop()` turned true (checked after each step). `reward_files`: the
    directory of a `file:` reward (default: data.tasks.reward_files())."""
    with open_run(config, job, reporter, metrics, trace, reward_files) as run:
        run.start()
        return run.train(on_step, stop)


@contextmanager
def open_run(
    config: JobConfig,
    job: str,
    reporter: Reporter,
    metrics: TrainerMetrics | None = None,
    trace: Path | None = None,
    reward_files: Path | None = None,
) -> Iterator[Run]:
    """The job's roles started on the connected Ray cluster, as a Run not yet started;
    on leaving, the trace is written and every role stopped (loop.setup)."""
    with open_parts(config, job, metrics, trace, reward_files) as parts:
        core = PPOTrainer(parts)
        streaming = AsyncPPOTrainer(core, parts) if parts.queue is not None else None
        evaluator = Evaluator(parts) if parts.held_out else None
        if evaluator is not None:  # it asks again what lost engines were answering
            parts.engines.listen(evaluator)
        yield Run(config, core, parts.metrics, reporter, streaming, evaluator)
