"""The role workers: plain classes, one data-parallel rank each (see workers.py).

    Actor    trains the policy (FSDP2), gives log π_old, hands its weights to rollout
    Ref      the frozen reference policy: log π_ref (a LoRA'd actor answers it itself
             when the ref is its own base: its adapter off, no second copy loaded)
    Critic   trains the value model (FSDP2), gives V(s_t)
    Rollout  a vLLM engine: generates, and loads the actor's weights after each update
    Reward   a reward model, when the spec names one instead of a reward function

Batches are the types of algo/experience.py, this rank's shard. Each worker builds
its model itself from the spec (a tiny model from its config and seed, or a path), so
no files need to travel between nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftModel
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
    kl_penalty,
    log_probs_and_entropy,
    log_probs_from_logits,
    masked_mean,
    truncated_importance_weights,
)
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import ref_answered_by_actor
from rlhf_trainer.models import COMPUTE_DTYPE, position_ids
from rlhf_trainer.roles.hf_export import Export, write_policy
from rlhf_trainer.roles.lora import adapted, adapter_files
from rlhf_trainer.roles.sharding import full_state_dict, trained_weights
from rlhf_trainer.roles.trainable import (
    Stats,
    Trainable,
    load_policy,
    per_token,
    prepare_frozen,
    prepare_trainable,
    scalar,
)
from rlhf_trainer.rollout.weight_sync import TransferSetup
from rlhf_trainer.worker import RankInfo, Worker

if TYPE_CHECKING:  # imports vLLM: only the actor's ranks that send need it
    from rlhf_trainer.rollout.push_verdict import WeightPush

log = logging.getLogger(__name__)


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
    tokens = batch.input_ids[:, 1:]
    if not with_entropy:
        log_probs = nn.functional.pad(log_probs_from_logits(logits, tokens), (1, 0))
        return log_probs, torch.zeros_like(log_probs)
    log_probs, entropy = log_probs_and_entropy(logits, tokens, entropy_grad)
    return nn.functional.pad(log_probs, (1, 0)), nn.functional.pad(entropy, (1, 0))


def without_dropout(model: nn.Module) -> nn.Module:
    """`model` with every dropout off, in train mode as in eval mode. PPO's ratio
    π_θ / π_old compares the loss's forward (train mode: gradient checkpointing runs
    only there) with π_old's, and π_old, the ref and the engines drop nothing out: the
    two must compute the same π, or the ratio is not 1 at identical weights and the clip
    acts on noise. So neither the adapter's dropout (models.actor.lora.dropout) nor a
    model's own (its config's attention_dropout, its nn.Dropout layers) applies to the
    actor."""
    for module in model.modules():
        if isinstance(module, DROPOUTS):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            # HF attention reads it in training (a float: nn.Module's typing says Module)
            module.attention_dropout = 0.0  # type: ignore[assignment]
    return model


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout)  # fmt: skip


def compose(
    after: Callable[[nn.Module], nn.Module], load: Callable[[bool], nn.Module]
) -> Callable[[bool], nn.Module]:
    """`load` (see `trainable.prepare_trainable`) with `after` applied to what it builds."""
    return lambda weights: after(load(weights))


class Actor(Trainable):
    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info, config)
        self.lora = config.models.actor.lora  # None: all the weights train
        load: Callable[[bool], nn.Module]
        load = partial(load_policy, config.models.actor, config.trainer.seed, torch.float32)
        if self.lora is not None:
            load = adapted(load, self.lora)  # wrapped before sharding: FSDP2 shards both
            if self.lora.dropout > 0:
                log.warning(
                    "models.actor.lora.dropout %g is not applied: PPO's ratio needs the "
                    "loss's π without dropout, as π_old's",
                    self.lora.dropout,
                )
        self.model = prepare_trainable(compose(without_dropout, load), config, info.device)
        # FSDP2 subclasses the model's class
        assert isinstance(self.model, PreTrainedModel | PeftModel), type(self.model)
        self.tied = bool(self.model.config.tie_word_embeddings)
        # The engines run in the compute dtype: send them that, not the fp32 masters.
        self.engine_dtype = COMPUTE_DTYPE[config.trainer.precision]
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: the adapter's
            lr=config.trainer.actor_learning_rate,
        )
        self.push: WeightPush | None = None  # this rank's side of the weight transfer
        self.engines: Any = None  # its VLLMWeightSyncClient (cluster.engine_client)
        # The ref beside the policy when it shares the actor's pool (a LoRA base is
        # answered by the model itself): built after the policy, as the ref's own
        # worker builds it, from the same seed.
        holds_ref = ref_answered_by_actor(config) and not config.models.ref_is_actor_base
        self.ref = load_ref(config, info.device) if holds_ref else None

    @torch.no_grad()
    def log_probs(self, batch: Sequences) -> Tensor:
        """(B, T) log π_old of the response tokens (0 elsewhere)."""
        return sequence_log_probs(self.model, batch, self.config, self.info.device)

    @torch.no_grad()
    def ref_log_probs(self, batch: Sequences) -> Tensor:
        """(B, T) log π_ref of the response tokens (0 elsewhere), when this actor answers
        for the ref (`plan.ref_answered_by_actor`): from the frozen ref it holds, or from
        its own base with the LoRA adapter off (`ModelsConfig.ref_is_actor_base`)."""
        if self.ref is not None:
            return sequence_log_probs(self.ref, batch, self.config, self.info.device)
        if not isinstance(self.model, PeftModel):
            raise RuntimeError("this actor holds no ref: the ref has workers of its own")
        with self.model.disable_adapter():
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

    def open_weight_transfer(self, setup: TransferSetup, engines: Any) -> None:
        """Set up the weight transfer to the rollout engines with vLLM's trainer-side
        factory; rank 0 sends and drives the engines through `engines` (an
        `EngineFanOut`). The backend is the one the engines were built with
        (`setup.backend`). Any transfer before is shut down first, on both sides: this
        rank's end, and (rank 0) each engine's. A collective of the actor's ranks."""
        from rlhf_trainer.rollout.push_verdict import open_push
        from rlhf_trainer.rollout.transfer_engines import PolicySource, trainer_init_info

        self.close()  # the transfer to the engines before (some since lost), if any
        self.engines = engines
        if self.lora is not None:
            return  # the adapter travels in Ray calls (send_weights): no transfer engine
        source = PolicySource(self.model, self.tied, self.engine_dtype)
        info = trainer_init_info(self.info.rank, setup, source.largest_tensor_bytes())
        try:
            if info.is_sender:
                engines.shutdown_weight_transfer_engine()
            self.push = open_push(info, engines, source)
        except Exception as error:
            raise RuntimeError(
                f"the {setup.backend} weight transfer from actor rank {self.info.rank} on "
                f"pool {self.info.pool} to the rollout engines could not start: {error}"
            ) from error

    def send_weights(self, version: int) -> None:
        """Hand the policy to every engine as `version`, and return once they serve it.
        A collective of the actor's ranks (each tensor is gathered whole); a push that
        fails raises the same PushFailed on every rank (`rollout.push_verdict`)."""
        if self.lora is not None:
            self.send_adapter(version)
            return
        assert self.push is not None, "open_weight_transfer first"
        self.push.send(version)

    def send_adapter(self, version: int) -> None:
        """Hand only the adapter to every engine (vLLM's LoRA support loads it over the
        base it keeps): gathered whole, then sent by rank 0 as bytes, in one Ray call per
        engine. A collective of the actor's ranks."""
        assert self.engines is not None, "open_weight_transfer first"
        files = adapter_files(self.model, self.engine_dtype, self.info.rank)
        if files is not None:
            self.engines.wait(self.engines.submit("load_adapter", files, version))

    def export(
        self, directory: str, dtype: str | None, step: int, adapter: bool = False
    ) -> Export | None:
        """Write the policy as a Hugging Face directory at `directory` (roles.hf_export):
        every rank's shards of what trains (LoRA: the adapter) are gathered to rank 0,
        which writes them. A collective of the actor's ranks; rank 0 returns the export,
        the others None. `adapter`: a LoRA'd actor's adapter alone."""
        weights = full_state_dict(self.model) if self.lora is None else trained_weights(self.model)
        if self.info.rank != 0:
            return None
        origin = f"actor rank 0 on pool {self.info.pool}"
        return write_policy(weights, self.config.models.actor, Path(directory), dtype, step,
                            origin, seed=self.config.trainer.seed, adapter=adapter)  # fmt: skip

    def close(self) -> None:
        if self.push is not None:
            self.push.shutdown()
            self.push = None


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


def load_ref(config: JobConfig, device: torch.device) -> nn.Module:
    """The frozen ref: models.ref, or the actor's initial model, in the compute dtype (it
    never trains: no fp32 master needed), sharded over its ranks (`prepare_frozen`)."""
    source = config.models.ref or config.models.actor
    dtype = COMPUTE_DTYPE[config.trainer.precision]
    return prepare_frozen(partial(load_policy, source, config.trainer.seed, dtype), dtype, device)


class Ref(Worker):
    """The ref's own workers, when it runs on a pool other than the actor's."""

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.model = load_ref(config, info.device)
        self.config = config

    @torch.no_grad()
    def ref_log_probs(self, batch: Sequences) -> Tensor:
        """(B, T) log π_ref of the response tokens (0 elsewhere)."""
        return sequence_log_probs(self.model, batch, self.config, self.info.device)
