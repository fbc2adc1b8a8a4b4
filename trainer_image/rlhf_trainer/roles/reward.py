"""A reward model: a sequence classifier that scores whole responses."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification

from rlhf_trainer.algo.experience import Sequences
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.models import position_ids
from rlhf_trainer.roles.trainable import micro_batches
from rlhf_trainer.worker import RankInfo, Worker


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
    def score(self, batch: Sequences) -> Tensor:
        """(B,) the model's score of each whole sequence."""
        scores = torch.zeros(len(batch))
        for rows, _, micro in micro_batches(batch, self.micro_size):
            scores[rows] = self._score(micro)
        return scores

    def _score(self, micro: Sequences) -> Tensor:
        mask = micro.attention_mask
        logits = self.model(
            input_ids=micro.input_ids, attention_mask=mask, position_ids=position_ids(mask)
        ).logits  # (B, 1): read at the last non-padding token
        scores: Tensor = logits[:, 0].float()
        return scores
