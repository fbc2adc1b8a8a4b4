"""A training run: start the roles, resume from the latest checkpoint, run the PPO
steps, checkpoint, and report progress (status, metrics, timeline)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlhf_trainer import checkpoint
from rlhf_trainer.checkpoint import TrainerState, capture_rng, restore_rng
from rlhf_trainer.cluster import RoleGroups
from rlhf_trainer.config import JobConfig, Role, TrainingProgress
from rlhf_trainer.data import PromptStream
from rlhf_trainer.loop import PPOTrainer, StepResult
from rlhf_trainer.metrics import TrainerMetrics
from rlhf_trainer.models import build_tokenizer
from rlhf_trainer.plan import plan_placement
from rlhf_trainer.report import Reporter
from rlhf_trainer.timeline import Timeline
from rlhf_trainer.workers import join

log = logging.getLogger(__name__)

CHECKPOINTED_ROLES = (Role.ACTOR, Role.CRITIC)


def load_tokenizer(config: JobConfig) -> PreTrainedTokenizerBase:
    tiny = config.models.actor.tiny
    if tiny is not None:
        return build_tokenizer(tiny.vocab_size)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.models.actor.path)
    return tokenizer


@dataclass
class Run:
    """The driver's side of a job: what it owns between steps."""

    config: JobConfig
    trainer: PPOTrainer
    metrics: TrainerMetrics
    reporter: Reporter
    step: int = 0
    last_checkpoint: str | None = None

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.config.trainer.checkpoint.path)

    def resume(self) -> None:
        """Continue from the latest committed checkpoint, if there is one."""
        latest = checkpoint.latest(self.checkpoint_root)
        if latest is None:
            return
        state = checkpoint.load_trainer_state(latest)
        groups = self.trainer.groups
        join(
            [
                ref
                for role in CHECKPOINTED_ROLES
                for ref in groups[role].run("load", str(latest / role))
            ]
        )
        self.trainer.prompts.seek(state.data_epoch, state.data_position)
        restore_rng(state.rng)
        self.step = state.step
        self.trainer.sync_weights(
            state.policy_version
        )  # the engines start from the initial weights
        self.last_checkpoint = str(latest)
        log.info("resumed from %s at step %d", latest, self.step)

    def save(self) -> None:
        """Write a checkpoint of everything the run needs, atomically."""
        staging = checkpoint.staging_dir(self.checkpoint_root, self.step)
        groups = self.trainer.groups
        join(
            [
                ref
                for role in CHECKPOINTED_ROLES
                for ref in groups[role].run("save", str(staging / role))
            ]
        )
        epoch, position = self.trainer.prompts.position()
        state = TrainerState(self.step, self.trainer.policy_version, epoch, position, capture_rng())
        checkpoint.save_trainer_state(staging, state)
        final = checkpoint.commit(self.checkpoint_root, self.step)
        checkpoint.prune(self.checkpoint_root, self.config.trainer.checkpoint.keep)
        self.last_checkpoint = str(final)

    def progress(self, result: StepResult | None) -> TrainingProgress:
        return TrainingProgress(
            step=self.step,
            total_steps=self.config.trainer.total_steps,
            samples_per_second=(
                self.config.trainer.batch_size / result.seconds if result else None
            ),
            policy_version=self.trainer.policy_version,
            reward_mean=result.reward_mean if result else None,
            last_checkpoint=self.last_checkpoint,
        )

    def observe(self, result: StepResult) -> None:
        m = self.metrics
        m.tokens_generated.inc(result.response_tokens)
        m.samples_trained.inc(self.config.trainer.batch_size)
        m.kl.set(result.kl)
        progress = self.progress(result)
        m.observe_progress(progress)
        self.reporter.report(progress, final=self.step == self.config.trainer.total_steps)

    def train(self, on_step: Callable[[StepResult], None] | None = None) -> TrainingProgress:
        total = self.config.trainer.total_steps
        every = self.config.trainer.checkpoint.every_steps
        result = None
        while self.step < total:
            self.step += 1
            result = self.trainer.step(self.step)
            log.info(
                "step %d/%d: reward %.6f, kl %.4f, %.2f s",
                self.step,
                total,
                result.reward_mean,
                result.kl,
                result.seconds,
            )
            if self.step % every == 0 or self.step == total:
                self.save()
            self.observe(result)
            if on_step is not None:
                on_step(result)
        return self.progress(result)


def run_job(
    config: JobConfig,
    job: str,
    reporter: Reporter,
    metrics: TrainerMetrics | None = None,
    trace: Path | None = None,
    on_step: Callable[[StepResult], None] | None = None,
) -> TrainingProgress:
    """Train the job on the connected Ray cluster; returns the final progress."""
    plan = plan_placement(config)
    metrics = metrics or TrainerMetrics(pools=[p.name for p in plan.pools])
    timeline = Timeline(listeners=[metrics.observe_span])
    tokenizer = load_tokenizer(config)
    prompts = PromptStream.load(
        config.data, config.trainer.seed, lambda text: list(tokenizer(text)["input_ids"])
    )
    started = time.time()
    groups = RoleGroups.start(plan, config, job)
    log.info("roles started in %.1f s", time.time() - started)
    try:
        trainer = PPOTrainer(
            config,
            groups,
            prompts,
            lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=False)),
            int(tokenizer.pad_token_id),
            timeline,
        )
        run = Run(config, trainer, metrics, reporter)
        run.resume()
        return run.train(on_step)
    finally:
        if trace is not None:
            timeline.write_chrome_trace(trace)
        groups.shutdown()
