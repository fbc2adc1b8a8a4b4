"""Training prompts: loaded once, tokenised, and served in seeded epochs.

The stream's position (epoch, index) is all a checkpoint needs to resume the same
order: each epoch's order is a pure function of the seed and the epoch number.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_trainer.api.sections import DataConfig
from rlhf_trainer.data.sources import PromptInput, Source, load_prompt_rows, source_name

log = logging.getLogger(__name__)

Tokenize = Callable[[PromptInput], tuple[str, list[int]]]  # -> (the text, its token ids)
# A check of a row's other columns (multiTurn: the environment it names), raising a
# ValueError that the loader prefixes with the source and the row's number.
CheckRow = Callable[[dict[str, Any]], object]


def prompt_tokenizer(tokenizer: Any, chat_template: bool | None) -> Tokenize:
    """Plain prompts are tokenised as they are; conversations through the tokenizer's
    chat template (data.chatTemplate; unset: used when the tokenizer has one), ending
    with the assistant's turn opened for the response."""
    use_template = (
        bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template
    )

    def tokenize(prompt: PromptInput) -> tuple[str, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(tokenizer(prompt)["input_ids"])
        if not use_template:
            raise ValueError(
                "data.train holds chat conversations, but data.chatTemplate is off or the "
                "tokenizer has no chat template"
            )
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return tokenize


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]
    fields: dict[str, Any] = field(default_factory=dict)  # reward keyword arguments


@dataclass
class PromptStream:
    """Batches of prompts, epoch after epoch, reshuffled each epoch when `shuffle`."""

    prompts: list[Prompt]
    seed: int
    shuffle: bool = True
    epoch: int = 0
    index: int = 0  # next position in this epoch's order
    dropped: int = 0  # prompts left out at load, for being over maxPromptLength
    _order: tuple[int, list[int]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(
        cls, data: DataConfig, seed: int, tokenize: Tokenize, check_row: CheckRow | None = None
    ) -> PromptStream:
        """The training prompts (data.train), tokenised (see `load_prompts`)."""
        prompts, dropped = load_prompts(data, seed, tokenize, "train", check_row)
        return cls(prompts, seed, data.shuffle, dropped=dropped)

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


def load_prompts(
    data: DataConfig,
    seed: int,
    tokenize: Tokenize,
    source: Source,
    check_row: CheckRow | None = None,
) -> tuple[list[Prompt], int]:
    """Tokenise every prompt of `data.<source>`; one over `maxPromptLength` tokens is
    dropped (counted and logged), truncated to its last tokens, or an error, as
    data.overlongPrompts says. Every row passes `check_row` first. Returns the prompts
    and how many were dropped."""
    prompts, dropped, limit, named = [], 0, data.max_prompt_length, source_name(data, source)
    for number, row in enumerate(load_prompt_rows(data, seed, source)):
        if check_row is not None:
            try:
                check_row(row.fields)
            except ValueError as error:
                raise ValueError(f"{named}: row {number}, {error}") from error
        text, ids = tokenize(row.prompt)
        if len(ids) > limit and data.overlong_prompts == "error":
            raise ValueError(
                f"{named}: row {number} has {len(ids)} prompt tokens, over "
                f"maxPromptLength {limit} (data.overlongPrompts: error)"
            )
        if len(ids) > limit and data.overlong_prompts == "drop":
            dropped += 1
            continue
        prompts.append(Prompt(text, ids[-limit:], row.fields))  # the end: question, turn
    if dropped:
        log.warning("%s: dropped %d of %d prompts over maxPromptLength %d tokens",
                    named, dropped, dropped + len(prompts), limit)  # fmt: skip
    if not prompts:
        raise ValueError(f"{named}: every prompt is over maxPromptLength {limit} tokens")
    return prompts, dropped
