"""The role workers: plain classes, one data-parallel rank each (see workers.py).

    Actor    trains the policy (FSDP2), gives log π_old, hands its weights to rollout
    Ref      the frozen reference policy: log π_ref
    Critic   trains the value model (FSDP2), gives V(s_t)
    Rollout  a vLLM engine: generates, and loads the actor's weights after each update
    Reward   a reward model, when the spec names one instead of a reward function

Batches are the (B, T) dicts of experience.py, this rank's shard. Each worker builds
its model itself from the spec (a tiny model from its config and seed, or a path), so
no files need to travel between nodes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

from rlhf_trainer.checkpoint import load_role_state, save_role_state
from rlhf_trainer.config import JobConfig, ModelSource
from rlhf_trainer.experience import Batch, micro_batch_rows, minibatches, state_values, trimmed
from rlhf_trainer.models import ValueModel, build_tiny_model, position_ids, write_tiny_model
from rlhf_trainer.ppo import (
    aggregate,
    aggregation_normalizer,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    kl_penalty,
    log_probs_from_logits,
    masked_mean,
    truncated_importance_weights,
)
from rlhf_trainer.rollout import Rollout, RolloutEngine, engine_weights, serialize_weights
from rlhf_trainer.sharding import clip_gradients, full_state_dict, shard_model
from rlhf_trainer.weight_sync import SyncGroup, WeightSpec, send_weights, weight_specs
from rlhf_trainer.workers import RankInfo, Worker

Stats = dict[str, float]


def model_path(source: ModelSource, seed: int) -> str:
    """A directory (or hub id) for vLLM to load the model from; a tiny model is written
    to a fresh local directory, the same weights on every node for the same seed."""
    if source.tiny is None:
        assert source.path is not None  # the spec's rules: exactly one of path or tiny
        return source.path
    directory = Path(tempfile.mkdtemp(prefix="rlhf-tiny-model-"))
    return str(write_tiny_model(source.tiny, directory, seed))


def load_policy(source: ModelSource, seed: int) -> PreTrainedModel:
    """The causal LM, built in memory when tiny (saving it to load it back would not do:
    transformers writes only on rank 0 once torch.distributed is up)."""
    if source.tiny is not None:
        return build_tiny_model(source.tiny, seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    return model


def load_value_model(source: ModelSource, seed: int) -> ValueModel:
    """The critic: the source's transformer backbone with a fresh value head."""
    if source.tiny is not None:
        return ValueModel(build_tiny_model(source.tiny, seed).model)
    assert source.path is not None
    return ValueModel.from_pretrained(source.path)


def micro_batches(batch: Batch, size: int | None) -> Iterator[tuple[Tensor, slice, Batch]]:
    """`batch` in micro-batches of `size` rows (all of it when None), rows of similar
    length together and each cut to its own width: (rows, columns, micro-batch)."""
    for rows in micro_batch_rows(batch, size):
        micro, columns = trimmed({name: t[rows] for name, t in batch.items()})
        yield rows, columns, micro


def per_token(batch: Batch, size: int | None, outputs: Callable[[Batch], Tensor]) -> Tensor:
    """(B, T) `outputs` of each micro-batch, put back in the batch's layout, on the
    response tokens only (0 elsewhere)."""
    result = torch.zeros_like(batch["response_mask"])
    for rows, columns, micro in micro_batches(batch, size):
        result[rows, columns] = outputs(micro)
    return result * batch["response_mask"]


def policy_outputs(
    model: nn.Module, batch: Batch, temperature: float, with_entropy: bool = False
) -> tuple[Tensor, Tensor]:
    """(B, T) log π(x_t | x_<t) and (B, T) entropy of that distribution (0 unless asked).

    π is the distribution the rollout samples from: logits divided by the sampling
    temperature. Position 0 (and padding) gets 0: nothing before it predicts it.
    """
    mask = batch["attention_mask"]
    logits = (
        model(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask)
        ).logits[:, :-1]
        / temperature
    )  # (B, T-1, V): position t predicts token t+1
    log_probs = nn.functional.pad(log_probs_from_logits(logits, batch["input_ids"][:, 1:]), (1, 0))
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    return log_probs, nn.functional.pad(entropy_from_logits(logits.float()), (1, 0))


def scalar(value: Tensor) -> float:
    return float(value.detach())


def all_ranks_sum(value: Tensor) -> Tensor:
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total


class Trainable(Worker):
    """What the actor and the critic share: PPO epochs over mini-batches, gradient
    accumulation over micro-batches, clipping, and checkpoints of model + optimizer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.config = config

    def loss(self, micro: Batch, normalizer: Tensor) -> tuple[Tensor, Stats]:
        raise NotImplementedError

    def update(self, batch: Batch, step: int) -> Stats:
        """PPO epochs over this rank's shard; returns the mean of each statistic."""
        trainer = self.config.trainer
        world = self.info.world_size
        # The same order on a resumed run: it depends on the step, not on history.
        generator = torch.Generator().manual_seed(
            trainer.seed * 1_000_003 + step * 101 + self.info.rank
        )
        rows = len(batch["input_ids"])
        micro_stats: list[Stats] = []
        grad_norms: list[float] = []
        self.model.train()
        for _ in range(trainer.epochs):
            for indices in minibatches(rows, trainer.mini_batch_size // world, generator):
                mini = {name: t[indices] for name, t in batch.items()}
                mode = self.config.algorithm.loss_aggregation
                # The whole mini-batch's token (or sequence) count over all ranks, so
                # micro-batch losses add up to the mini-batch loss.
                normalizer = all_ranks_sum(aggregation_normalizer(mini["response_mask"], mode))
                self.optimizer.zero_grad(set_to_none=True)
                for _, _, micro in micro_batches(mini, trainer.micro_batch_size):
                    loss, stats = self.loss(micro, normalizer)
                    # FSDP averages gradients over the ranks; the normalizer already
                    # divides by the global count, so undo the average.
                    (loss * world).backward()  # type: ignore[no-untyped-call]
                    micro_stats.append(stats)
                grad_norms.append(clip_gradients(self.model, trainer.max_grad_norm))
                self.optimizer.step()
        self.model.eval()
        means = {
            name: sum(s[name] for s in micro_stats) / len(micro_stats) for name in micro_stats[0]
        }
        return {**means, "grad_norm": sum(grad_norms) / len(grad_norms)}

    def save(self, directory: str) -> None:
        save_role_state(Path(directory), self.model, self.optimizer)

    def load(self, directory: str) -> None:
        load_role_state(Path(directory), self.model, self.optimizer)


class Actor(Trainable):
    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info, config)
        model = load_policy(config.models.actor, config.trainer.seed)
        self.tied = bool(model.config.tie_word_embeddings)
        self.model = shard_model(model.to(info.device))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.trainer.actor_learning_rate
        )
        self.sync_group: SyncGroup | None = None  # fully async: to the rollout engines

    @torch.no_grad()
    def log_probs(self, batch: Batch) -> Tensor:
        """(B, T) log π_old of the response tokens (0 elsewhere)."""
        return sequence_log_probs(self.model, batch, self.config)

    def loss(self, micro: Batch, normalizer: Tensor) -> tuple[Tensor, Stats]:
        algorithm = self.config.algorithm
        mask = micro["response_mask"]
        log_probs, entropy = policy_outputs(
            self.model, micro, self.config.generation.temperature, algorithm.entropy_coef > 0
        )
        policy = clipped_policy_loss(
            log_probs,
            micro["old_log_probs"],
            micro["advantages"],
            algorithm.clip_ratio,
            algorithm.dual_clip,
        )
        # Off-policy correction between the engine that sampled and the trainer.
        weights = truncated_importance_weights(
            micro["old_log_probs"], micro["rollout_log_probs"], mask, algorithm.importance_cap
        )
        per_token = policy.loss * weights.weights - algorithm.entropy_coef * entropy
        if algorithm.kl_mode == "loss" and "ref_log_probs" in micro:
            kl = kl_penalty(log_probs, micro["ref_log_probs"], algorithm.kl_estimator)
            per_token = per_token + algorithm.kl_coef * kl
        loss = aggregate(per_token, mask, algorithm.loss_aggregation, normalizer)
        return loss, {
            "policy_loss": scalar(masked_mean(policy.loss, mask)),
            "clip_fraction": scalar(masked_mean(policy.clipped.float(), mask)),
            "entropy": scalar(masked_mean(entropy, mask)),
            "approx_kl_old": scalar(masked_mean(micro["old_log_probs"] - log_probs, mask)),
            "importance_clipped": scalar(weights.clipped_fraction),
        }

    def open_weight_sync(self, host: str, port: int, world_size: int) -> list[WeightSpec] | None:
        """Rank 0 hosts the weight-sync group of fully-async mode (rank 0 of it; the
        engines join as the other ranks) and returns the specs of what it will send.
        A collective of the actor's ranks."""
        state = engine_weights(full_state_dict(self.model), self.tied)
        if self.info.rank != 0:
            return None
        self.sync_group = SyncGroup.create(host, port, 0, world_size, self.info.device)
        return weight_specs(state)

    def send_weights(self, bucket_bytes: int) -> None:
        """Broadcast the policy to the engines in buckets. A collective of the actor's
        ranks (gathering the full weights) and of the sync group."""
        state = full_state_dict(self.model)
        if self.info.rank == 0:
            assert self.sync_group is not None, "open_weight_sync first"
            send_weights(self.sync_group, engine_weights(state, self.tied), bucket_bytes)

    def rollout_weights(self) -> bytes | None:
        """The policy for the rollout engines, as safetensors bytes on rank 0 (None on
        the others). A collective: every rank must call it."""
        state = full_state_dict(self.model)
        if self.info.rank != 0:
            return None
        return serialize_weights(engine_weights(state, self.tied))


def sequence_log_probs(model: nn.Module, batch: Batch, config: JobConfig) -> Tensor:
    temperature = config.generation.temperature
    return per_token(
        batch,
        config.trainer.micro_batch_size,
        lambda micro: policy_outputs(model, micro, temperature)[0],
    )


class Ref(Worker):
    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        source = config.models.ref or config.models.actor
        self.model = load_policy(source, config.trainer.seed).to(info.device).eval()
        self.config = config

    @torch.no_grad()
    def log_probs(self, batch: Batch) -> Tensor:
        """(B, T) log π_ref of the response tokens (0 elsewhere)."""
        return sequence_log_probs(self.model, batch, self.config)


class Critic(Trainable):
    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info, config)
        source = config.models.critic or config.models.actor
        model = load_value_model(source, config.trainer.seed)
        self.model = shard_model(model.to(info.device))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.trainer.critic_learning_rate
        )

    def predict(self, batch: Batch) -> Tensor:
        token_values = self.model(batch["input_ids"], batch["attention_mask"])
        return state_values(token_values) * batch["response_mask"]

    @torch.no_grad()
    def values(self, batch: Batch) -> Tensor:
        """(B, T) V(s_t) for the response tokens (0 elsewhere)."""
        return per_token(batch, self.config.trainer.micro_batch_size, self.predict)

    def loss(self, micro: Batch, normalizer: Tensor) -> tuple[Tensor, Stats]:
        algorithm = self.config.algorithm
        mask = micro["response_mask"]
        values = self.predict(micro)
        per_token = clipped_value_loss(
            values, micro["values"], micro["returns"], algorithm.value_clip
        )
        loss = aggregate(per_token, mask, algorithm.loss_aggregation, normalizer)
        return loss, {"value_loss": scalar(masked_mean(per_token, mask))}


class RolloutWorker(Worker):
    """A vLLM engine. It needs no process group of its own (vLLM makes its own)."""

    needs_process_group = False

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.config = config
        generation = config.generation
        self.engine = RolloutEngine(
            model_path(config.models.actor, config.trainer.seed),
            max_model_len=config.data.max_prompt_length + config.data.max_response_length,
            gpu_memory_utilization=generation.gpu_memory_utilization,
            tensor_parallel_size=generation.tensor_parallel_size,
            seed=config.trainer.seed,
        )

    def generate(self, prompts: list[list[int]], step: int) -> list[Rollout]:
        generation = self.config.generation
        # A seed per step and rank: a resumed run samples what the first one would have.
        seed = (self.config.trainer.seed * 1_000_003 + step) * 1_009 + self.info.rank * 100_003
        return self.engine.generate(
            prompts,
            max_tokens=self.config.data.max_response_length,
            temperature=generation.temperature,
            top_p=generation.top_p,
            seed=seed % 2**31,
        )

    def load_weights(self, payload: bytes, version: int) -> None:
        self.engine.load_serialized_weights(payload, version)

    def close(self) -> None:
        self.engine.shutdown()


class RewardModel(Worker):
    """A reward model: a sequence classifier with one label, read at the last token."""

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        assert config.models.reward.path is not None  # else the reward is a function
        model: Any = AutoModelForSequenceClassification.from_pretrained(
            config.models.reward.path, num_labels=1, dtype=torch.float32
        )
        self.model = model.to(info.device).eval()
        self.micro_size = config.trainer.micro_batch_size

    @torch.no_grad()
    def score(self, batch: Batch) -> Tensor:
        """(B,) the model's score of each whole sequence."""
        scores = torch.zeros(len(batch["input_ids"]))
        for rows, _, micro in micro_batches(batch, self.micro_size):
            scores[rows] = self._score(micro)
        return scores

    def _score(self, micro: Batch) -> Tensor:
        mask = micro["attention_mask"]
        logits = self.model(
            input_ids=micro["input_ids"], attention_mask=mask, position_ids=position_ids(mask)
        ).logits  # (B, 1): read at the last non-padding token
        scores: Tensor = logits[:, 0].float()
        return scores
