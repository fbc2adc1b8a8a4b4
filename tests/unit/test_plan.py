"""The placement planner on the layouts of the examples (8-GPU split, two nodes, 6/2, 3/5, async)."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import DRIVER, Mode, Phase, describe, in_actor_processes, plan_placement
from tests.specs import job_config as config

SPLIT_ROLES = {"actor": "a", "rollout": "a", "ref": "a", "critic": "b", "reward": "b"}


def pools_of(plan: Any) -> dict[str, tuple[int, int, int, tuple[Role, ...]]]:
    return {p.name: (p.nodes, p.gpus_per_node, p.total_gpus, p.roles) for p in plan.pools}


def test_one_8_gpu_node_split_4_4() -> None:
    plan = plan_placement(
        config([{"name": "a", "gpusPerNode": 4}, {"name": "b", "gpusPerNode": 4}], SPLIT_ROLES)
    )
    assert plan.mode is Mode.SPLIT
    assert pools_of(plan) == {
        "a": (1, 4, 4, (Role.ACTOR, Role.ROLLOUT, Role.REF)),
        "b": (1, 4, 4, (Role.CRITIC, Role.REWARD)),
    }
    assert plan.roles[Role.ACTOR].data_parallel_size == 4
    assert plan.roles[Role.CRITIC].data_parallel_size == 4
    assert plan.total_gpus == 8
    # the point of split placement: the two updates and the three scorers overlap
    assert plan.concurrent(Phase.UPDATE_ACTOR, Phase.UPDATE_CRITIC)
    assert plan.concurrent(Phase.REF_LOG_PROB, Phase.VALUES)
    assert plan.concurrent(Phase.REF_LOG_PROB, Phase.REWARD)
    assert not plan.concurrent(Phase.VALUES, Phase.REWARD)  # same pool: one after another
    assert not plan.concurrent(Phase.GENERATE, Phase.UPDATE_ACTOR)  # different stages
    assert [s.name for s in plan.stages] == ["generate", "score", "update", "sync"]


@pytest.mark.parametrize(
    ("replicas", "gpus_per_node"),
    [(2, 4), (1, 8)],
    ids=["per-node-4+4-on-each", "by-node-8|8"],
)
def test_two_8_gpu_nodes(replicas: int, gpus_per_node: int) -> None:
    pools = [{"name": n, "replicas": replicas, "gpusPerNode": gpus_per_node} for n in "ab"]
    plan = plan_placement(config(pools, SPLIT_ROLES, generation={"tensorParallelSize": 2}))
    assert {p.name: (p.nodes, p.gpus_per_node, p.total_gpus) for p in plan.pools} == {
        "a": (replicas, gpus_per_node, 8),
        "b": (replicas, gpus_per_node, 8),
    }
    rollout = plan.roles[Role.ROLLOUT]
    assert (rollout.gpus, rollout.tensor_parallel_size, rollout.data_parallel_size) == (8, 2, 4)
    assert plan.roles[Role.ACTOR].data_parallel_size == 8


@pytest.mark.parametrize(("actor_gpus", "critic_gpus"), [(6, 2), (3, 5)])
def test_asymmetric_splits(actor_gpus: int, critic_gpus: int) -> None:
    pools = [{"name": "a", "gpusPerNode": actor_gpus}, {"name": "b", "gpusPerNode": critic_gpus}]
    plan = plan_placement(config(pools, SPLIT_ROLES))
    assert plan.roles[Role.ACTOR].data_parallel_size == actor_gpus
    # The ref shares the actor's pool: the actor's ranks hold it, and no ref rank starts.
    assert Role.REF not in plan.roles and plan.phase_role[Phase.REF_LOG_PROB] is Role.ACTOR
    assert plan.roles[Role.CRITIC].data_parallel_size == critic_gpus
    assert plan.roles[Role.REWARD].data_parallel_size == critic_gpus
    assert plan.concurrent(Phase.UPDATE_ACTOR, Phase.UPDATE_CRITIC)


def test_fully_async_rollout_pool_streams_to_trainer_pool() -> None:
    roles = {
        "rollout": "gen",
        "actor": "train",
        "ref": "train",
        "critic": "train",
        "reward": "train",
    }
    pools = [{"name": "gen", "gpusPerNode": 8}, {"name": "train", "gpusPerNode": 8}]
    plan = plan_placement(config(pools, roles, **{"async": {"stalenessThreshold": 0.5}}))
    assert plan.mode is Mode.ASYNC
    assert [(lane.pool, lane.phases) for lane in plan.background] == [("gen", (Phase.GENERATE,))]
    assert Phase.GENERATE not in {p for s in plan.stages for lane in s.lanes for p in lane.phases}
    assert plan.concurrent(Phase.GENERATE, Phase.UPDATE_ACTOR)
    assert plan.concurrent(Phase.GENERATE, Phase.REF_LOG_PROB)
    assert not plan.concurrent(Phase.UPDATE_ACTOR, Phase.UPDATE_CRITIC)  # one trainer pool
    # generation is off the critical path: a step costs the slower of the two sides
    times = dict.fromkeys(Phase, 1.0) | {Phase.GENERATE: 10.0}
    assert plan.step_seconds(times) == 10.0
    assert plan.step_seconds(times | {Phase.GENERATE: 2.0}) == 7.0


def test_everything_colocated_in_one_pool() -> None:
    roles = dict.fromkeys(("actor", "rollout", "ref", "critic", "reward"), "all")
    plan = plan_placement(config([{"name": "all", "gpusPerNode": 8}], roles))
    assert plan.mode is Mode.COLOCATED
    assert pools_of(plan)["all"][3] == tuple(Role)
    assert not any(plan.concurrent(a, b) for a in Phase for b in Phase)
    assert all(len(stage.lanes) == 1 for stage in plan.stages)
    assert plan.step_seconds(dict.fromkeys(Phase, 1.0)) == len(Phase)
    # The critic and the reward model start in the actor's processes, not in their own.
    assert in_actor_processes(plan) == [Role.CRITIC, Role.REWARD]
    assert "  critic: all, dp=8, in the actor's processes" in describe(plan).splitlines()


def test_only_roles_on_the_actors_pool_live_in_its_processes() -> None:
    pools = [{"name": "a", "gpusPerNode": 4}, {"name": "b", "gpusPerNode": 4}]
    assert in_actor_processes(plan_placement(config(pools, SPLIT_ROLES))) == []
    critic_beside = SPLIT_ROLES | {"critic": "a"}
    assert in_actor_processes(plan_placement(config(pools, critic_beside))) == [Role.CRITIC]
    rule = {"actor": {"path": "m"}, "reward": {"function": "toy_copy"}}  # on the driver
    colocated = dict.fromkeys(SPLIT_ROLES, "a") | {"reward": None}
    plan = plan_placement(config(pools[:1], colocated, models=rule))
    assert in_actor_processes(plan) == [Role.CRITIC]
    assert "  critic: b, dp=4" in describe(plan_placement(config(pools, SPLIT_ROLES))).split("\n")


def test_ideal_split_step_time_is_the_slower_lane_of_each_stage() -> None:
    times = {Phase.GENERATE: 5.0, Phase.ACTOR_LOG_PROB: 1.0, Phase.REF_LOG_PROB: 1.0,
             Phase.VALUES: 1.5, Phase.REWARD: 1.0, Phase.UPDATE_ACTOR: 4.0,
             Phase.UPDATE_CRITIC: 3.0, Phase.SYNC_WEIGHTS: 0.5}  # fmt: skip
    pools = [{"name": "a", "gpusPerNode": 4}, {"name": "b", "gpusPerNode": 4}]
    split = plan_placement(config(pools, SPLIT_ROLES))
    colocated = plan_placement(
        config([{"name": "a", "gpusPerNode": 8}], dict.fromkeys(SPLIT_ROLES, "a"))
    )
    assert colocated.step_seconds(times) == pytest.approx(sum(times.values()))
    # generate + max(actor+ref log-probs, values+reward) + max(actor, critic) + sync
    assert split.step_seconds(times) == pytest.approx(5.0 + 2.5 + 4.0 + 0.5)


def test_rule_based_reward_runs_on_the_driver_and_ref_is_optional() -> None:
    spec = config([{"name": "a", "gpusPerNode": 2}], {"actor": "a", "rollout": "a", "critic": "a"},
                  models={"actor": {"path": "m"}, "reward": {"function": "toy_copy"}},
                  algorithm={"klCoef": 0.0})  # fmt: skip
    plan = plan_placement(spec)
    assert plan.roles[Role.REWARD].pool == DRIVER
    assert Role.REF not in plan.roles
    assert Phase.REF_LOG_PROB not in plan.phases()
    assert plan.concurrent(Phase.REWARD, Phase.VALUES)  # CPU reward overlaps GPU scoring


def test_a_stage_is_found_by_name_and_a_misspelt_one_is_refused() -> None:
    plan = plan_placement(
        config([{"name": "a", "gpusPerNode": 4}, {"name": "b", "gpusPerNode": 4}], SPLIT_ROLES)
    )
    assert [lane.phases for lane in plan.stage("update").lanes] == [
        (Phase.UPDATE_ACTOR,),
        (Phase.UPDATE_CRITIC,),
    ]
    with pytest.raises(KeyError, match="no stage 'scroe'"):
        plan.stage("scroe")


def test_a_critic_free_split_job_places_rollout_and_actor_apart_with_no_critic() -> None:
    plan = plan_placement(
        config(
            [{"name": "a", "gpusPerNode": 4}, {"name": "b", "gpusPerNode": 4}],
            {"actor": "a", "ref": "a", "rollout": "b", "reward": "a"},
            algorithm={"advantageEstimator": "grpo"},
            generation={"samplesPerPrompt": 4},
        )
    )
    assert plan.mode is Mode.SPLIT
    assert pools_of(plan) == {
        "a": (1, 4, 4, (Role.ACTOR, Role.REF, Role.REWARD)),
        "b": (1, 4, 4, (Role.ROLLOUT,)),
    }
    assert Role.CRITIC not in plan.roles
    assert Phase.VALUES not in plan.phases() and Phase.UPDATE_CRITIC not in plan.phases()
    assert [lane.phases for lane in plan.stage("update").lanes] == [(Phase.UPDATE_ACTOR,)]
