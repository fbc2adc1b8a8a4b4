"""The held-out evaluation: pass@k and its scores against naive versions, when it is
due, and what it reports."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
import yaml

from rlhf_trainer.algo.eval_scores import eval_scores, pass_at_k
from rlhf_trainer.algo.experience import Episode, Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import DataConfig, EvalGeneration
from rlhf_trainer.loop.evaluation import eval_due, evaluation_of
from tests.specs import LOCAL_EXAMPLE


def naive_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of all k-subsets of the responses that hold a passing one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(naive_pass_at_k(outcomes, k)), (n, c, k)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match=f"n={n} c={c} k={k}"):
            pass_at_k(n, c, k)


def test_eval_scores_match_a_loop_over_prompts() -> None:
    rng = random.Random(0)
    prompts, n, threshold = 7, 4, 0.5
    rewards = torch.tensor(
        [[rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)] for _ in range(prompts)]
    )
    lengths = torch.randint(1, 20, (prompts, n))
    scores = eval_scores(rewards, lengths, threshold)
    passes = [[float(r) >= threshold for r in row] for row in rewards]
    assert scores.reward_mean == pytest.approx(sum(map(sum, rewards.tolist())) / (prompts * n))
    assert scores.pass_at_1 == pytest.approx(sum(map(sum, passes)) / (prompts * n))
    assert scores.pass_at_k == pytest.approx(sum(any(row) for row in passes) / prompts)
    assert scores.response_length_mean == pytest.approx(float(lengths.float().mean()))


def test_one_response_per_prompt_has_no_pass_at_k() -> None:
    scores = eval_scores(torch.tensor([[1.0], [0.0]]), torch.tensor([[3], [5]]), 1.0)
    assert scores.pass_at_1 == 0.5 and scores.pass_at_k is None


def job(**trainer: int) -> JobConfig:
    spec = yaml.safe_load(LOCAL_EXAMPLE.read_text())["spec"]
    spec["trainer"] = {
        key: value for key, value in spec["trainer"].items() if key != "evalEverySteps"
    }
    spec["trainer"].update(trainer)
    return JobConfig.model_validate(spec)


def test_evaluations_are_due_before_training_every_n_steps_and_at_the_end() -> None:
    due = [step for step in range(51) if eval_due(job(totalSteps=50, evalEverySteps=20), step)]
    assert due == [0, 20, 40, 50]
    assert [s for s in range(51) if eval_due(job(totalSteps=50), s)] == [0, 50]
    no_eval = job(totalSteps=50).model_copy(update={"data": DataConfig(train="toy:copy")})
    assert not any(eval_due(no_eval, step) for step in range(51))


def answer(version_spans: tuple[tuple[int, int], ...], tokens: int = 3) -> Rollout:
    return Rollout(
        [1, 2], list(range(tokens)), [0.0] * tokens, True, version_spans[0][0], version_spans
    )


def test_an_evaluation_reports_its_policy_version_and_refuses_a_mixed_one() -> None:
    sampling = EvalGeneration(samples_per_prompt=2, temperature=1.0, pass_reward=1.0)
    answers = [answer(((4, 0),)), answer(((4, 0),), tokens=5)] * 2
    report = evaluation_of(8, answers, torch.tensor([1.0, 0.0, 0.0, 0.0]), sampling)
    assert (report.step, report.policy_version, report.prompts) == (8, 4, 2)
    assert (report.pass_at_1, report.pass_at_k, report.response_length_mean) == (0.25, 0.5, 4.0)
    with pytest.raises(RuntimeError, match=r"after step 8 spans versions \[4, 5\]"):
        evaluation_of(8, [answer(((4, 0), (5, 2))), *answers[1:]], torch.zeros(4), sampling)


def test_a_multi_turn_evaluation_reports_how_its_episodes_went() -> None:
    sampling = EvalGeneration(samples_per_prompt=1, temperature=0.0, pass_reward=1.0)
    calls_and_cuts = [(0, None), (2, None), (1, "max_turns"), (0, "environment_error: 503")]
    played = [
        replace(answer(((3, 0),)), episode=Episode(0.0, turns=1 + calls, tool_calls=calls,
                                                   version_span=0, cut=cut))
        for calls, cut in calls_and_cuts
    ]  # fmt: skip
    report = evaluation_of(5, played, torch.zeros(4), sampling)
    assert (report.tool_call_rate, report.tool_calls_mean, report.cut_ratio) == (0.5, 0.75, 0.5)
    single_turn = evaluation_of(5, [answer(((3, 0),))] * 4, torch.zeros(4), sampling)
    assert (single_turn.tool_call_rate, single_turn.tool_calls_mean, single_turn.cut_ratio) == (
        None,
        None,
        None,
    )
