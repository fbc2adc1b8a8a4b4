"""LoRA RL in the spec (`models.actor.lora`): what it accepts, what it refuses for now
(each naming the field, in pydantic and in the CRD's CEL alike), the engines' rank, and
the plan in which the actor answers for the ref."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.__main__ import in_run_folder
from rlhf_trainer.api.config import AsyncConfig, Role
from rlhf_trainer.api.lora import VLLM_MAX_LORA_RANKS, engine_max_lora_rank
from rlhf_trainer.api.plan import Phase, describe, plan_placement
from rlhf_trainer.telemetry.run_folder import RunFolder
from tests.unit.celcheck import assert_refused, cel_errors

Job = dict[str, Any]


@pytest.fixture
def lora_job(local_job: Job) -> Job:
    """The local example on one pool, its actor LoRA'd: the supported case."""
    spec = local_job["spec"]
    spec["pools"] = [p for p in spec["pools"] if p["name"] == "policy"]
    spec["roles"]["critic"] = "policy"
    spec["models"]["actor"]["lora"] = {"rank": 8, "targetModules": ["q_proj", "v_proj"]}
    return local_job


def test_a_lora_job_on_one_pool_is_accepted_with_peft_s_defaults(lora_job: Job) -> None:
    assert cel_errors(lora_job) == []
    lora = parse_job(lora_job).spec.models.actor.lora
    assert lora is not None
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (
        8,
        32,
        0.0,
        ["q_proj", "v_proj"],
    )


def _lora(**fields: Any) -> Callable[[Job], None]:
    def apply(job: Job) -> None:
        job["spec"]["models"]["actor"]["lora"] |= fields

    return apply


ALLOWED = "one of 1, 8, 16, 32, 64, 128, 256, 320, 512"

# (case, mutation, field named, words the message says, whether CEL refuses it too)
CASES: list[tuple[str, Callable[[Job], None], str, str, bool]] = [
    ("rank-above-vllm", _lora(rank=1024), "spec.models.actor.lora.rank",
     f"at most 512, the largest max_lora_rank vLLM serves ({ALLOWED}) (got 1024)", True),
    ("rank-zero", _lora(rank=0), "spec.models.actor.lora.rank", "greater than or equal to 1",
     False),
    ("alpha-zero", _lora(alpha=0), "spec.models.actor.lora.alpha", "greater than or equal to 1", False),
    ("dropout-one", _lora(dropout=1.0), "spec.models.actor.lora.dropout", "less than 1", False),
    ("no-targets", _lora(targetModules=[]), "spec.models.actor.lora.targetModules",
     "at least 1 item", False),
    ("target-not-a-name", _lora(targetModules=["layers.0.q_proj"]),
     "spec.models.actor.lora.targetModules[0]", "should match pattern", False),
    ("unknown-field", _lora(rnak=8), "spec.models.actor.lora.rnak", "unknown field", False),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "path", "words", "cel_too"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_what_lora_does_not_support_is_refused_naming_the_field(
    lora_job: Job, mutate: Callable[[Job], None], path: str, words: str, cel_too: bool
) -> None:
    mutate(lora_job)
    assert_refused(lora_job, path, words, cel_too)


def test_the_ranks_are_vllm_s() -> None:
    from vllm.config.lora import MaxLoRARanks

    assert get_args(MaxLoRARanks) == VLLM_MAX_LORA_RANKS


def test_an_engine_takes_the_smallest_max_lora_rank_that_holds_the_adapter() -> None:
    for rank in range(1, 513):  # every rank a spec may ask for
        naive = min(r for r in VLLM_MAX_LORA_RANKS if r >= rank)
        assert engine_max_lora_rank(rank) == naive, rank


def test_a_rank_above_vllm_s_largest_is_refused_by_the_engine_too() -> None:
    with pytest.raises(ValueError, match=r"models\.actor\.lora\.rank 513 is above"):
        engine_max_lora_rank(513)


def test_the_actor_answers_for_the_ref_when_the_ref_is_its_base(lora_job: Job) -> None:
    """No ref workers: the ref's log-probs run on the actor, after its own, on its pool.
    A ref model of its own (models.ref) is held beside the policy, as without LoRA, and
    gets workers of its own only on a pool of its own."""
    config = parse_job(lora_job).spec.job_config()
    plan = plan_placement(config)
    assert Role.REF not in plan.roles
    assert plan.phase_role[Phase.REF_LOG_PROB] is Role.ACTOR
    (score,) = [s for s in plan.stages if s.name == "score"]
    (lane,) = [lane for lane in score.lanes if lane.pool == "policy"]  # the reward: driver
    assert lane.phases == (Phase.ACTOR_LOG_PROB, Phase.REF_LOG_PROB, Phase.VALUES)
    assert "ref: on the actor's ranks" in describe(plan)
    lora_job["spec"]["models"]["ref"] = {"tiny": {"hiddenSize": 128}}
    plan = plan_placement(parse_job(lora_job).spec.job_config())
    assert Role.REF not in plan.roles and plan.phase_role[Phase.REF_LOG_PROB] is Role.ACTOR
    lora_job["spec"]["pools"].append({"name": "ref", "replicas": 1, "gpusPerNode": 1})
    lora_job["spec"]["roles"]["ref"] = "ref"
    plan = plan_placement(parse_job(lora_job).spec.job_config())
    assert Role.REF in plan.roles and plan.phase_role[Phase.REF_LOG_PROB] is Role.REF


def test_a_lora_job_keeps_checkpoints_and_writes_its_adapter_or_the_merged_model(
    lora_job: Job,
) -> None:
    lora_job["spec"] |= {"checkpointClaim": "team-checkpoints",
                         "output": {"path": "/checkpoints/policy", "lora": "adapter"}}  # fmt: skip
    assert cel_errors(lora_job) == []
    output = parse_job(lora_job).spec.output
    assert output is not None and output.lora == "adapter"


def test_the_critic_may_train_an_adapter_of_its_own(lora_job: Job) -> None:
    lora_job["spec"]["models"]["critic"] = {"tiny": {"hiddenSize": 128}, "lora": {"rank": 8}}
    assert cel_errors(lora_job) == []
    critic = parse_job(lora_job).spec.models.critic
    assert critic is not None and critic.lora is not None and critic.lora.rank == 8


def test_an_adapter_export_without_lora_is_refused(lora_job: Job) -> None:
    del lora_job["spec"]["models"]["actor"]["lora"]
    lora_job["spec"] |= {"checkpointClaim": "team-checkpoints",
                         "output": {"path": "/checkpoints/policy", "lora": "adapter"}}  # fmt: skip
    assert_refused(lora_job, "spec.output.lora", "adapter needs models.actor.lora", True)


def test_a_local_run_s_folder_is_added_to_a_config_that_is_validated_again(
    lora_job: Job, tmp_path: Path
) -> None:
    """`rlhfjob train` adds its run folder's checkpoints and model/ (a LoRA'd actor's
    too) and validates the result, so a config changed by code cannot skip a rule."""
    config = parse_job(lora_job).spec.job_config()
    folder = RunFolder(tmp_path / "run")
    run = in_run_folder(config, folder)
    assert run.trainer.checkpoint.path == str(folder.checkpoints)
    assert run.output is not None and run.output.path == str(folder.model.resolve())
    assert run.models == config.models
    # Fully async with the rollout on the actor's pool, made without validation.
    fully_async = config.model_copy(update={"async_": AsyncConfig()})
    with pytest.raises(ValidationError, match="fully async needs the rollout on a pool of its own"):
        in_run_folder(fully_async, folder)


def test_without_a_ref_a_lora_job_has_no_ref_phase(lora_job: Job) -> None:
    lora_job["spec"]["algorithm"] = {"klCoef": 0.0}
    del lora_job["spec"]["roles"]["ref"]
    plan = plan_placement(parse_job(lora_job).spec.job_config())
    assert Role.REF not in plan.roles
    assert Phase.REF_LOG_PROB not in plan.phases()
