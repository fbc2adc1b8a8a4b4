"""A reward model: a sequence classifier that scores whole responses.

A reward model trained with another tokenizer than the actor's cannot read the actor's
token ids: each sequence is decoded with the actor's tokenizer and encoded again with
the reward model's (special tokens dropped: the actor's mean nothing to it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_trainer.algo.experience import Sequences
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import ModelSource
from rlhf_trainer.models import load_tokenizer, position_ids
from rlhf_trainer.roles.trainable import micro_batches, prepare_frozen
from rlhf_trainer.worker import RankInfo, Worker


class RewardModel(Worker):
    """A reward model: a sequence classifier with one label, read at the last token."""

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        path = config.models.reward.path
        assert path is not None  # else the reward is a function
        self.model = prepare_frozen(partial(load_reward_model, path), torch.float32, info.device)
        self.micro_size = config.trainer.micro_batch_size
        self.retokenize = retokenizer(config.models.actor, path)

    @torch.no_grad()
    def score(self, batch: Sequences) -> Tensor:
        """(B,) the model's score of each whole sequence."""
        scores = torch.zeros(len(batch))
        # On the CPU: a retokenizer decodes the ids there.
        for rows, _, micro in micro_batches(batch, self.micro_size, torch.device("cpu")):
            scores[rows] = self._score(micro).cpu()
        return scores

    def _score(self, micro: Sequences) -> Tensor:
        ids, mask = micro.input_ids, micro.attention_mask
        if self.retokenize is not None:
            ids, mask = self.retokenize(ids, mask)
        ids, mask = ids.to(self.info.device), mask.to(self.info.device)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)
        ).logits  # (B, 1): read at the last non-padding token
        scores: Tensor = logits[:, 0].float()
        return scores


def load_reward_model(path: str, weights: bool = True) -> Any:
    """A sequence classifier with one label, in fp32; weights=False: the architecture
    only, its initial weights (for the meta device)."""
    if not weights:
        architecture = AutoConfig.from_pretrained(path, num_labels=1)
        return AutoModelForSequenceClassification.from_config(architecture, dtype=torch.float32)
    return AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32
    )


Retokenize = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def retokenizer(actor: ModelSource, reward_path: str) -> Retokenize | None:
    """None when the reward model reads the actor's tokens (the same vocabulary, or no
    tokenizer of its own); else (B, T) actor ids and mask -> the reward model's."""
    directory = Path(reward_path)
    if directory.is_dir() and not (directory / "tokenizer_config.json").exists():
        return None  # no tokenizer of its own: it was trained on the actor's ids
    theirs: Any = AutoTokenizer.from_pretrained(reward_path)
    ours = load_tokenizer(actor)
    if theirs.get_vocab() == ours.get_vocab():
        return None
    theirs.padding_side = "left"  # as the actor's batches: read at the last token
    if theirs.pad_token is None:
        theirs.pad_token = theirs.eos_token

    def retokenize(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        texts = [
            ours.decode(row[row_mask.bool()].tolist(), skip_special_tokens=True)
            for row, row_mask in zip(ids, mask, strict=True)
        ]
        encoded = theirs(texts, return_tensors="pt", padding=True)
        return encoded["input_ids"], encoded["attention_mask"]

    return retokenize
