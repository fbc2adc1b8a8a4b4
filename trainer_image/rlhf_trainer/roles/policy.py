"""The role workers: plain classes, one data-parallel rank each (see workers.py).

    Actor    trains the policy (FSDP2), gives log π_old, hands its weights to rollout
    Ref      the frozen reference policy: log π_ref
    Critic   trains the value model (FSDP2), gives V(s_t)
    Rollout  a vLLM engine: generates, and loads the actor's weights after each update
    Reward   a reward model, when the spec names one instead of a reward function

Batches are the types of algo/experience.py, this rank's shard. Each worker builds
its model itself from the spec (a tiny model from its config and seed, or a path), so
no files need to travel between nodes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlhf_trainer.algo.experience import (
    Experience,
    Sequences,
)
from rlhf_trainer.algo.ppo import (
    aggregate,
    approx_kl,
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    log_probs_from_logits,
    masked_mean,
    truncated_importance_weights,
)
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import COMPUTE_DTYPE, position_ids
from rlhf_trainer.roles.sharding import full_state_dict
from rlhf_trainer.roles.trainable import (
    Stats,
    Trainable,
    load_policy,
    per_token,
    prepare_trainable,
    scalar,
)
from rlhf_trainer.rollout.engine_weights import engine_weights
from rlhf_trainer.rollout.weight_sync import (
    SyncGroup,
    WeightSpec,
    open_sync_group,
    send_weights,
    weight_specs,
)
from rlhf_trainer.worker import RankInfo, Worker


def policy_outputs(
    model: nn.Module,
    batch: Sequences,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """(B, T) log π(x_t | x_<t) and (B, T) entropy of that distribution (0 unless asked;
    with a gradient only if `entropy_grad`, for an entropy bonus).

    π is the distribution the rollout samples from: logits divided by the sampling
    temperature. Position 0 (and padding) gets 0: nothing before it predicts it.
    """
    mask = batch.attention_mask
    logits = (
        model(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids(mask)
        ).logits[:, :-1]
        / temperature
    )  # (B, T-1, V): position t predicts token t+1
    log_probs = nn.functional.pad(log_probs_from_logits(logits, batch.input_ids[:, 1:]), (1, 0))
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    entropy_logits = logits.float() if entropy_grad else logits.detach().float()
    return log_probs, nn.functional.pad(entropy_from_logits(entropy_logits), (1, 0))


class Actor(Trainable):
    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info, config)
        load = partial(load_policy, config.models.actor, config.trainer.seed, torch.float32)
        self.model = prepare_trainable(load, config, info.device)
        assert isinstance(self.model, PreTrainedModel)  # FSDP2 subclasses the model's class
        self.tied = bool(self.model.config.tie_word_embeddings)
        # The engines run in the compute dtype: send them that, not the fp32 masters.
        self.engine_dtype = COMPUTE_DTYPE[config.trainer.precision]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.trainer.actor_learning_rate
        )
        self.sync_group: SyncGroup | None = None  # to the rollout engines (rank 0)

    @torch.no_grad()
    def log_probs(self, batch: Sequences) -> Tensor:
        """(B, T) log π_old of the response tokens (0 elsewhere)."""
        return sequence_log_probs(self.model, batch, self.config, self.info.device)

    def loss(self, micro: Experience, normalizer: Tensor) -> tuple[Tensor, Stats]:
        algorithm = self.config.algorithm
        mask = micro.response_mask
        log_probs, entropy = policy_outputs(
            self.model,
            micro,
            self.config.generation.temperature,
            with_entropy=True,  # reported either way
            entropy_grad=algorithm.entropy_coef > 0,
        )
        policy = clipped_policy_loss(
            log_probs,
            micro.old_log_probs,
            micro.advantages,
            *algorithm.clip_range(),
            algorithm.dual_clip,
        )
        # Off-policy correction between the engine that sampled and the trainer.
        weights = truncated_importance_weights(
            micro.old_log_probs, micro.rollout_log_probs, mask, algorithm.importance_cap
        )
        per_token = policy.loss * weights.weights - algorithm.entropy_coef * entropy
        if algorithm.kl_mode == "loss" and micro.ref_log_probs is not None:
            kl = kl_penalty(log_probs, micro.ref_log_probs, algorithm.kl_estimator)
            per_token = per_token + algorithm.kl_coef * kl
        loss = aggregate(per_token, mask, algorithm.loss_aggregation, normalizer)
        return loss, {
            "policy_loss": scalar(masked_mean(policy.loss, mask)),
            "clip_fraction": scalar(masked_mean(policy.clipped.float(), mask)),
            "entropy": scalar(masked_mean(entropy, mask)),
            "approx_kl": scalar(masked_mean(approx_kl(log_probs, micro.old_log_probs), mask)),
            "importance_capped": scalar(weights.clipped_fraction),
        }

    def open_weight_sync(
        self, host: str, port: int, world_size: int, device: str, timeout_s: float
    ) -> list[WeightSpec] | None:
        """Rank 0 hosts the weight-sync group (rank 0 of it; the engines join as the
        other ranks) and returns the specs of what it will send. `device`: see
        `weight_sync.sync_device`; `timeout_s`: how long its collectives may wait. A
        collective of the actor's ranks."""
        state = self.engine_state()
        if self.info.rank != 0:
            return None
        self.sync_group = open_sync_group(host, port, 0, world_size, device, timeout_s)
        return weight_specs(state)

    def send_weights(self, bucket_bytes: int) -> None:
        """Broadcast the policy to the engines in buckets. A collective of the actor's
        ranks (gathering the full weights) and of the sync group."""
        state = self.engine_state()
        if self.info.rank == 0:
            assert self.sync_group is not None, "open_weight_sync first"
            send_weights(self.sync_group, state, bucket_bytes)

    def engine_state(self) -> dict[str, Tensor]:
        """The weights as the engines load them, in their dtype: on rank 0 ({} on the
        others). A collective of the actor's ranks."""
        state = engine_weights(full_state_dict(self.model), self.tied)
        return {name: tensor.to(self.engine_dtype) for name, tensor in state.items()}


def sequence_log_probs(
    model: nn.Module, batch: Sequences, config: JobConfig, device: torch.device
) -> Tensor:
    temperature = config.generation.temperature
    return per_token(
        batch,
        config.trainer.micro_batch_size,
        lambda micro: policy_outputs(model, micro, temperature)[0],
        device,
    )


class Ref(Worker):
    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        source = config.models.ref or config.models.actor
        dtype = COMPUTE_DTYPE[config.trainer.precision]  # frozen: no fp32 master needed
        self.model = load_policy(source, config.trainer.seed, dtype).to(info.device).eval()
        self.config = config

    @torch.no_grad()
    def log_probs(self, batch: Sequences) -> Tensor:
        """(B, T) log π_ref of the response tokens (0 elsewhere)."""
        return sequence_log_probs(self.model, batch, self.config, self.info.device)
