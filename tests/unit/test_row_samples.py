"""Rows of several samples (an agent episode's: algo.row_samples) and the group baselines
over groups given row by row, against naive references (dicts of plain Python floats)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest
import torch

from rlhf_trainer.algo import estimators
from rlhf_trainer.algo.experience import EpisodeSample, Rollout
from rlhf_trainer.algo.row_samples import RowSamples
from rlhf_trainer.rollout.samples import Sample


def rollout(tag: int, version: int = 0, others: tuple[EpisodeSample, ...] = ()) -> Rollout:
    return Rollout([tag], [tag, tag], [-0.5, -0.5], True, version, others=others)


def naive_baseline(scores: list[float], groups: list[int], kind: str, divide: bool) -> list[float]:
    members: dict[int, list[float]] = defaultdict(list)
    for score, group in zip(scores, groups, strict=True):
        members[group].append(score)
    out = []
    for score, group in zip(scores, groups, strict=True):
        mine = members[group]
        if max(mine) == min(mine):
            out.append(0.0)
        elif kind == "rloo":
            out.append(score - (sum(mine) - score) / (len(mine) - 1))
        elif divide:
            std = statistics.stdev(mine) if len(mine) > 1 else 0.0
            out.append((score - statistics.fmean(mine)) / (std + estimators.GROUP_STD_EPS))
        else:
            out.append(score - statistics.fmean(mine))
    return out


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("kind", "divide"), [("grpo", True), ("grpo", False), ("rloo", True)])
def test_baselines_over_uneven_scattered_groups_match_the_naive_reference(
    seed: int, kind: str, divide: bool
) -> None:
    generator = torch.Generator().manual_seed(seed)
    rows = 17
    # Every group two rows at least, the rest scattered: numbers not 0..G-1, uneven sizes.
    numbers = torch.cat(
        [torch.arange(5).repeat(2), torch.randint(0, 5, (rows - 12,), generator=generator)]
    )
    groups = torch.cat(
        [torch.tensor([100, 100]), numbers[torch.randperm(rows - 2, generator=generator)] * 3 + 7]
    )
    scores = torch.randint(0, 4, (rows,), generator=generator).double() / 3
    scores[:2] = 0.5  # group 100: all equal
    if kind == "rloo":
        actual = estimators.leave_one_out(scores, groups)
    else:
        actual = estimators.group_normalized(scores, groups, divide)
    expected = naive_baseline(scores.tolist(), groups.tolist(), kind, divide)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=scores.dtype))
    assert actual[:2].tolist() == [0.0, 0.0]


def test_contiguous_group_numbers_give_what_the_group_size_gives() -> None:
    scores = torch.tensor([1.0, 0.0, 0.3, 0.3, 2.0, 1.0])
    by_size = estimators.group_normalized(scores, 2)
    by_index = estimators.group_normalized(scores, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.equal(by_size, by_index)
    informative = estimators.informative_groups(scores, torch.tensor([4, 4, 9, 9, 2, 2]))
    assert informative.tolist() == [True, True, False]  # in the numbers' order: 2, 4, 9


def test_group_numbers_must_be_one_a_row_and_loo_needs_two_a_group() -> None:
    with pytest.raises(ValueError, match="group numbers"):
        estimators.group_normalized(torch.ones(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="2 or more"):
        estimators.leave_one_out(torch.ones(3), torch.tensor([0, 0, 1]))


def test_a_rows_samples_share_its_reward_and_its_group() -> None:
    episode = rollout(5, others=(EpisodeSample(rollout(3), 0.25), EpisodeSample(rollout(4), 0.5)))
    rows = [rollout(1), rollout(2), episode, rollout(6)]
    samples = RowSamples.of(rows)
    assert [r.prompt_token_ids[0] for r in samples.rollouts] == [1, 2, 3, 4, 5, 6]
    assert samples.rows.tolist() == [0, 1, 2, 2, 2, 3]
    assert samples.own.tolist() == [0, 1, 4, 5]
    assert samples.groups(group_size=2).tolist() == [0, 0, 1, 1, 1, 1]
    scores = samples.scores(torch.tensor([1.0, math.nan, 2.0, 4.0]))
    assert scores[[0, 2, 3, 4, 5]].tolist() == [1.0, 0.5, 1.0, 2.0, 4.0]
    assert math.isnan(scores[1])  # a row left unscored: each of its samples too


def test_rows_of_one_sample_each_are_the_rows_themselves() -> None:
    rows = [rollout(i) for i in range(4)]
    samples = RowSamples.of(rows)
    assert samples.rollouts == rows and samples.rows.tolist() == [0, 1, 2, 3]
    row_scores = torch.tensor([0.7, 1 / 3, 0.1, 2.0])
    assert torch.equal(samples.scores(row_scores), row_scores)


def test_a_queued_episode_keeps_its_other_samples_and_is_as_stale_as_the_oldest() -> None:
    episode = rollout(5, version=4, others=(EpisodeSample(rollout(3, version=2), 0.5),))
    sample = Sample(7, 1, episode)
    assert sample.oldest_version == 2
    again = Sample.from_json(sample.to_json())
    assert again == sample


@pytest.mark.parametrize(
    ("samples", "multiple", "padding"), [(6, 4, 2), (9, 4, 3), (7, 4, 5), (8, 4, 0), (5, 1, 0)]
)
def test_padding_fills_whole_multiples_never_with_one_row_alone(
    samples: int, multiple: int, padding: int
) -> None:
    from rlhf_trainer.algo.row_samples import padding_rows

    assert padding_rows(samples, multiple) == padding


def test_a_padded_batch_masks_its_padding_in_a_group_of_its_own() -> None:
    episode = rollout(5, others=(EpisodeSample(rollout(3), 0.5),))
    samples = RowSamples.of([rollout(1), episode, rollout(2), rollout(4)], multiple=4)
    assert len(samples) == 5 and samples.padding == 3 and len(samples.batch) == 8
    assert all(r.response_token_ids == [] for r in samples.batch[5:])
    assert samples.groups(group_size=2).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    scores = samples.scores(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert scores.tolist() == [1.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0]
    loo = estimators.leave_one_out(scores, samples.groups(group_size=2))
    assert loo[5:].tolist() == [0.0, 0.0, 0.0]
    # Rows of one sample each are never padded: the batch is as it always was.
    assert RowSamples.of([rollout(1), rollout(2), rollout(3)], multiple=4).padding == 0
