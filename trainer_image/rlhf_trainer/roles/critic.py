"""The critic: the value model, trained with the clipped value loss."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from rlhf_trainer.algo.experience import Experience, Sequences, state_values
from rlhf_trainer.algo.ppo import aggregate, clipped_value_loss, masked_mean
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import ValueModel
from rlhf_trainer.roles.lora import adapted_backbone
from rlhf_trainer.roles.trainable import (
    Stats,
    Trainable,
    load_value_model,
    per_token,
    prepare_trainable,
    scalar,
)
from rlhf_trainer.worker import RankInfo


class Critic(Trainable):
    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info, config)
        source = config.models.critic or config.models.actor
        load: Callable[[bool], ValueModel]
        load = partial(load_value_model, source, config.trainer.seed)
        lora = config.models.critic.lora if config.models.critic else None
        if lora is not None:  # the backbone frozen under an adapter; the value head whole
            load = adapted_backbone(load, lora)
        self.model = prepare_trainable(load, config, info.device)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.trainer.critic_learning_rate,
        )

    def predict(self, batch: Sequences) -> Tensor:
        token_values = self.model(batch.input_ids, batch.attention_mask)
        return state_values(token_values) * batch.response_mask

    @torch.no_grad()
    def values(self, batch: Sequences) -> Tensor:
        """(B, T) V(s_t) for the response tokens (0 elsewhere)."""
        size = self.config.trainer.micro_batch_size
        return per_token(batch, size, self.predict, self.info.device)

    def loss(self, micro: Experience, normalizer: Tensor) -> tuple[Tensor, Stats]:
        algorithm = self.config.algorithm
        mask = micro.response_mask
        values = self.predict(micro)
        assert micro.values is not None and micro.returns is not None, "scored without a critic"
        value = clipped_value_loss(values, micro.values, micro.returns, algorithm.value_clip)
        loss = aggregate(value.loss, mask, algorithm.loss_aggregation, normalizer)
        return loss, {
            "value_loss": scalar(masked_mean(value.loss, mask)),
            "value_clip_fraction": scalar(masked_mean(value.clipped.float(), mask)),
        }
