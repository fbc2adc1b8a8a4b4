"""DAPO's dynamic sampling, for both modes: keep only the groups whose rewards differ,
and draw more until the batch is full.

A group whose n rewards are all equal has zero advantage under every group baseline,
so it adds nothing to the update but noise in the batch size. The synchronous loop draws
by generating more prompts; fully async draws by admitting more prompts and taking their
samples from the queue. Either way the drawing is the caller's, and the rounds, the
counting and the cap are here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from rlhf_trainer.algo.estimators import informative_groups
from rlhf_trainer.api.config import JobConfig

Item = TypeVar("Item")  # one sample, as the caller keeps it


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling ran out of rounds before the batch was full."""


@dataclass(frozen=True)
class Kept(Generic[Item]):
    items: list[Item]  # (B·n,) whole groups whose rewards differ, a group's together
    scores: torch.Tensor  # (B·n,) their rewards
    dropped: int  # groups dropped on the way


def keep_informative_groups(
    step: int,
    config: JobConfig,
    draw: Callable[[int, int], Sequence[Item]],
    score: Callable[[Sequence[Item]], torch.Tensor],
) -> Kept[Item]:
    """A step's batch (batchSize groups of samplesPerPrompt) of groups whose rewards
    differ. `draw(count, attempt)` returns `count` new whole groups; `score(items)`
    their (count·n,) rewards. Raises DynamicSamplingExhausted, naming the counts, after
    dynamicSampling.maxAttempts draws."""
    assert config.algorithm.dynamic_sampling is not None, "dynamic sampling is off"
    max_attempts = config.algorithm.dynamic_sampling.max_attempts
    groups, group_size = config.trainer.batch_size, config.generation.samples_per_prompt
    kept: list[Item] = []
    scores: list[torch.Tensor] = []
    dropped = 0
    for attempt in range(max_attempts):
        missing = groups - len(kept) // group_size
        drawn = draw(missing, attempt)
        drawn_scores = score(drawn)
        keep = informative_groups(drawn_scores, group_size).repeat_interleave(group_size)
        dropped += missing - int(keep.sum()) // group_size
        kept += [item for item, k in zip(drawn, keep.tolist(), strict=True) if k]
        scores.append(drawn_scores[keep])
        if len(kept) == groups * group_size:
            return Kept(kept, torch.cat(scores), dropped)
    raise DynamicSamplingExhausted(
        f"step {step}: after {max_attempts} rounds (algorithm.dynamicSampling.maxAttempts) "
        f"only {len(kept) // group_size} of {groups} groups had rewards that differ "
        f"({dropped} dropped): the task is too easy or too hard for the policy, or the "
        "reward does not vary"
    )
