"""Training prompts: loaded once, tokenised, and served in seeded epochs.

The stream's position (epoch, index) is all a checkpoint needs to resume the same
order: each epoch's order is a pure function of the seed and the epoch number.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_trainer.api.sections import DataConfig

Encode = Callable[[str], list[int]]

TOY_PROMPTS = 4096  # prompts a toy task generates (an epoch)


def load_prompt_texts(data: DataConfig, seed: int) -> list[str]:
    """The prompts of `data.train`: a built-in `toy:<task>`, or a JSONL file whose
    records hold the prompt under `data.promptKey`."""
    if data.train.startswith("toy:"):
        from rlhf_trainer.data.tasks import toy_prompts

        return [p.text for p in toy_prompts(data.train, TOY_PROMPTS, seed)]
    path = Path(data.train)
    if path.suffix != ".jsonl":
        raise ValueError(f"data.train: expected 'toy:<task>' or a .jsonl file, got {data.train!r}")
    texts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get(data.prompt_key), str):
            raise ValueError(f"{path}:{number}: no string field {data.prompt_key!r} (promptKey)")
        texts.append(record[data.prompt_key])
    if not texts:
        raise ValueError(f"{path}: no prompts")
    return texts


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]


@dataclass
class PromptStream:
    """Batches of prompts, epoch after epoch, reshuffled each epoch when `shuffle`."""

    prompts: list[Prompt]
    seed: int
    shuffle: bool = True
    epoch: int = 0
    index: int = 0  # next position in this epoch's order
    _order: tuple[int, list[int]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, data: DataConfig, seed: int, encode: Encode) -> PromptStream:
        """Tokenise every prompt, keeping its last `maxPromptLength` tokens."""
        texts = load_prompt_texts(data, seed)
        prompts = [Prompt(t, encode(t)[-data.max_prompt_length :]) for t in texts]
        return cls(prompts, seed, data.shuffle)

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            # Kept: shuffling every call made taking prompts one by one O(dataset) each.
            indices = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(f"{self.seed}/{epoch}").shuffle(indices)
            self._order = (epoch, indices)
        return self._order[1]

    def next_batch(self, size: int) -> list[Prompt]:
        """The next `size` prompts, rolling into the next epoch when one runs out."""
        return [self.prompts[i] for i in self.next_indices(size)]

    def next_indices(self, size: int) -> list[int]:
        """The indices (into `prompts`) of the next `size` prompts."""
        indices: list[int] = []
        order = self.order(self.epoch)
        while len(indices) < size:
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self.order(self.epoch)
            indices.append(order[self.index])
            self.index += 1
        return indices

    def position(self) -> tuple[int, int]:
        return self.epoch, self.index

    def seek(self, epoch: int, index: int) -> None:
        if not 0 <= index <= len(self.prompts):
            raise ValueError(f"data position {index} is outside 0..{len(self.prompts)}")
        self.epoch, self.index = epoch, index
