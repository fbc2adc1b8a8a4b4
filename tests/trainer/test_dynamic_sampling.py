"""Dynamic sampling's rounds, counts and cap (`loop.dynamic_sampling`), with draws made
of plain numbers: each drawn item is its own reward."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.loop.dynamic_sampling import DynamicSamplingExhausted, keep_informative_groups
from rlhf_trainer.rollout.queue import AdmissionControl
from tests.specs import critic_free_job


def scored(items: Sequence[float]) -> torch.Tensor:
    return torch.tensor(list(items))


def job(groups: int, max_attempts: int) -> JobConfig:
    """Groups of 2, `groups` a step (copied past validation: only the counts matter)."""
    config = critic_free_job(
        "grpo",
        "colocated",
        total_steps=1,
        checkpoint_dir=Path("/tmp/unused"),
        samples_per_prompt=2,
        algorithm={"dynamicSampling": {"maxAttempts": max_attempts}},
    )
    return config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"batch_size": groups})}
    )


def test_groups_with_equal_rewards_are_dropped_and_drawn_again_until_the_batch_is_full() -> None:
    rounds = iter([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1], [1, 0]])  # groups of 2
    asked: list[tuple[int, int]] = []

    def draw(groups: int, attempt: int) -> list[float]:
        asked.append((groups, attempt))
        return next(rounds)

    kept = keep_informative_groups(1, job(3, 5), draw, scored)
    assert asked == [(3, 0), (2, 1), (1, 2)]  # only the missing groups, round after round
    assert kept.items == [0, 1, 0, 1, 1, 0]
    assert kept.scores.tolist() == kept.items
    assert kept.dropped == 3


def test_running_out_of_rounds_raises_naming_the_counts() -> None:
    def draw(groups: int, attempt: int) -> list[float]:
        return ([0, 1] if attempt == 0 else [1, 1]) + [1, 1] * (groups - 1)

    with pytest.raises(
        DynamicSamplingExhausted,
        match=r"step 7: after 2 rounds .* only 1 of 2 groups .* \(2 dropped\)",
    ):
        keep_informative_groups(7, job(2, 2), draw, scored)


def test_dropped_groups_leave_the_admission_count() -> None:
    admission = AdmissionControl(batch_size=4, sync_every=1, staleness=0)
    while admission.try_admit():
        pass
    assert admission.admitted_since_sync == 4
    admission.on_dropped(3)
    assert [admission.try_admit() for _ in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError, match="5 dropped, but 4 admitted since the sync"):
        admission.on_dropped(5)
