"""Critic-free RL end to end on a simulated Ray cluster with real vLLM: GRPO learns the
toy task colocated and fully async; RLOO (fully async) and REINFORCE++ (split: the
rollout on a pool of its own) run with dynamic sampling. (Dynamic sampling's cap:
test_dynamic_sampling.py. That a split placement trains the colocated run's policy,
sample for sample: test_ppo_loop.py.)

8 prompts x 4 responses a step (the samples of the PPO tests' 32 prompts). Measured on
2 cores: GRPO's fitted rise over 20 steps is +0.11 (t = 7.4) colocated (and split, with
the same rewards), and +0.10 fully async. The fully-async run takes log π_old from the
rollout engine (`oldLogProbs: rollout`, as verl's does): its actor never scores a batch
before updating on it, and it learns all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_env.rewards import reward_app_for
from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.rollout.queue import admission_limit
from tests.environments import served
from tests.specs import critic_free_job
from tests.trainer.learning import assert_reward_rises
from tests.trainer.local_runs import Trained, train
from tests.trainer.rewards import starts_with_a_letter

pytestmark = pytest.mark.slow  # each trains a whole run (about a minute)

STEPS = 20
N = 4  # samples per prompt
MIN_RISE = 0.05  # measured: +0.11 (t = 7.4) sync, +0.10 async over 20 steps


@pytest.fixture(scope="module")
def grpo_colocated(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    tmp = tmp_path_factory.mktemp("colocated")
    return train(critic_free_job("grpo", "colocated", total_steps=STEPS, checkpoint_dir=tmp))


@pytest.fixture(scope="module")
def grpo_async(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    tmp = tmp_path_factory.mktemp("async")
    return train(
        critic_free_job(
            "grpo",
            "async",
            total_steps=STEPS,
            checkpoint_dir=tmp,
            algorithm={"oldLogProbs": "rollout"},
        )
    )


@pytest.fixture(scope="module", params=["grpo_colocated", "grpo_async"])
def grpo(request: pytest.FixtureRequest) -> Trained:
    result: Trained = request.getfixturevalue(request.param)
    return result


def test_grpo_learns_the_toy_task_with_no_critic_anywhere(grpo: Trained) -> None:
    assert_reward_rises([s.reward_mean for s in grpo.steps], MIN_RISE)
    assert all(s.critic is None for s in grpo.steps)
    phases = {e["name"] for e in grpo.trace["traceEvents"] if e["ph"] == "X"}
    assert Phase.UPDATE_ACTOR in phases
    # π_old recomputed by the actor, or taken from the rollout (the fully-async run)
    rollout_log_probs = grpo.config.algorithm.old_log_probs == "rollout"
    assert (Phase.ACTOR_LOG_PROB not in phases) == rollout_log_probs
    assert all(s.rollout_log_prob_diff == 0 for s in grpo.steps) == rollout_log_probs
    assert not phases & {Phase.VALUES, Phase.UPDATE_CRITIC}
    roles = {e["args"].get("role") for e in grpo.trace["traceEvents"] if "args" in e}
    assert Role.CRITIC not in roles
    registry = grpo.metrics.registry
    assert registry.get_sample_value("rlhf_samples_trained_total") == STEPS * 8 * N
    assert registry.get_sample_value("rlhf_critic_grad_norm") is None  # never registered


def test_async_grpo_trains_each_group_once_whole_and_as_stale_as_its_oldest(
    grpo_async: Trained,
) -> None:
    uids = [uid for s in grpo_async.steps for uid in s.sample_uids]
    assert len(uids) == len(set(uids)) == STEPS * 8 * N  # each sample trained once
    for step in grpo_async.steps:
        for start in range(0, len(step.sample_uids), N):
            group = step.sample_uids[start : start + N]
            assert group == list(range(group[0], group[0] + N)) and group[0] % N == 0, group
            lags = step.staleness[start : start + N]
            assert len(set(lags)) == 1, f"the samples of group {group} are {lags} stale"


@pytest.mark.parametrize(("estimator", "placement"), [("rloo", "async"), ("reinforce++", "split")])
def test_dynamic_sampling_trains_only_groups_whose_rewards_differ(
    estimator: str, placement: str, tmp_path: Path
) -> None:
    """A binary reward and groups of 2: a young policy's groups are often all 0 or all 1.
    Synchronous runs generate more prompts in their place; fully async ones admit more.
    Both are scored by a reward service (models.reward.url), each sample as it finishes:
    the same rule, served over HTTP by rlhf_env's reward app."""
    scored: list[str] = []

    def served_rule(prompt: str, response: str, **row: object) -> float:
        scored.append(response)
        return starts_with_a_letter(prompt, response, **row)

    with served({"reward": reward_app_for(served_rule)}) as url:
        config = critic_free_job(
            estimator,
            placement,
            total_steps=3,
            checkpoint_dir=tmp_path,
            samples_per_prompt=2,
            algorithm={"dynamicSampling": {"maxAttempts": 30}, "clipRatioHigh": 0.28},
            reward={"url": f"{url}/reward"},
        )
        trained = train(config)
    dropped = sum(s.dropped_groups for s in trained.steps)
    assert dropped > 0
    # The service scored the held-out answers and each sample once as it finished: those
    # trained, those of the groups dropped, and (fully async) at most the admission
    # limit's worth still outstanding when the run ended.
    held_out = sum(e.prompts for s in trained.steps for e in s.evaluations)
    held_out *= config.generation.eval.samples_per_prompt
    trained_samples = sum(len(s.sample_uids) for s in trained.steps)
    if placement == "async":
        assert config.async_ is not None
        sync, staleness = (
            config.async_.trigger_parameter_sync_step,
            config.async_.staleness_threshold,
        )
        ahead = admission_limit(config.trainer.batch_size, sync, staleness) * 2  # groups of 2
        floor = trained_samples + 2 * dropped + held_out
        assert floor <= len(scored) <= floor + ahead, (floor, len(scored))
    else:
        trained_samples = config.trainer.batch_size * 2 * len(trained.steps)
        assert len(scored) == trained_samples + 2 * dropped + held_out
    assert trained.metrics.registry.get_sample_value("rlhf_dropped_groups_total") == dropped
    # every kept group has one response rewarded 1 and one 0: the batch's mean is 0.5
    assert [s.reward_mean for s in trained.steps] == [0.5] * 3
    assert all(s.actor.grad_norm > 0 for s in trained.steps)
    uids = [uid for s in trained.steps for uid in s.sample_uids]
    assert len(uids) == len(set(uids))  # fully async: no sample trained twice
