"""From rollouts to a training batch, the prompt stream, and the loop's small helpers."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.algo.estimators import compute_advantages
from rlhf_trainer.algo.experience import (
    Rollout,
    Sequences,
    mean_kl,
    micro_batch_rows,
    minibatches,
    pack_rollouts,
    state_values,
)
from rlhf_trainer.algo.ppo import gae, whiten
from rlhf_trainer.api.algorithm import AlgorithmConfig
from rlhf_trainer.api.reward import RewardSource
from rlhf_trainer.data.prompts import Prompt, PromptStream
from rlhf_trainer.data.tasks import reward_function, toy_copy
from rlhf_trainer.loop.sync import max_abs_diff, split_list
from rlhf_trainer.roles.trainable import per_token

PAD = 0


def rollout(prompt: list[int], response: list[int], version: int = 0) -> Rollout:
    return Rollout(
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_log_probs=[-0.5 - i for i in range(len(response))],
        finished=True,
        policy_version=version,
    )


def test_rollouts_pack_with_prompts_left_and_responses_right() -> None:
    batch = pack_rollouts([rollout([1, 5, 6], [7, 2]), rollout([1, 5], [8, 9, 2], 3)], PAD)
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 2, 0], [0, 1, 5, 8, 9, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert batch.rollout_log_probs.tolist() == [
        [0, 0, 0, -0.5, -1.5, 0],
        [0, 0, 0, -0.5, -1.5, -2.5],
    ]
    assert batch.policy_version.tolist() == [0, 3]


def test_a_multi_turn_response_counts_only_its_sampled_tokens() -> None:
    """Turn 1 (7 2), a tool result the environment added (4 4), turn 2 (8 2): all are
    attended to, only the turns are trained on, and their log-probs are the engine's."""
    two_turns = Rollout(
        prompt_token_ids=[1, 5],
        response_token_ids=[7, 2, 4, 4, 8, 2],
        response_log_probs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
        finished=True,
        policy_version=0,
        loss_mask=(1, 1, 0, 0, 1, 1),
    )
    batch = pack_rollouts([two_turns, rollout([1, 5], [9, 2])], PAD)
    assert batch.attention_mask.tolist()[0] == [1] * 8
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0]]
    assert batch.rollout_log_probs[0].tolist() == pytest.approx(
        [0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4]
    )
    with pytest.raises(ValueError, match="a loss mask of 2 for 6 tokens"):
        Rollout([1], [7, 2, 4, 4, 8, 2], [0.0] * 6, True, 0, loss_mask=(1, 1))


def test_gae_steps_over_the_tool_results_between_turns() -> None:
    """GAE over a masked middle equals GAE over the sampled tokens alone: the tool
    result is part of the environment's transition from one turn to the next."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.1, -0.2, 5.0, 5.0, 0.3, 1.0]])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.2, 0.1]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    sampled = mask[0].bool()
    alone, alone_returns = gae(
        rewards[:, sampled], values[:, sampled], torch.ones(1, 4), gamma=0.9, lam=0.8
    )
    assert advantages[0, sampled].tolist() == pytest.approx(alone[0].tolist())
    assert returns[0, sampled].tolist() == pytest.approx(alone_returns[0].tolist())
    assert advantages[0, 2:4].tolist() == [0.0, 0.0]


def test_an_empty_response_packs_to_a_row_with_nothing_to_train() -> None:
    batch = pack_rollouts([rollout([1, 5], [])], PAD)
    assert batch.response_mask.sum() == 0
    assert batch.input_ids.shape == (1, 3)


def test_state_values_are_the_model_outputs_one_position_earlier() -> None:
    outputs = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert state_values(outputs).tolist() == [[0.0, 1.0, 2.0, 3.0]]


def naive_advantages(
    scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """Per row: reward = -coef*(logp - ref) on each response token, + score on the last;
    then GAE over the response tokens only, as loops over Python floats."""
    advantages = torch.zeros_like(values)
    for row in range(len(scores)):
        positions = [t for t in range(mask.shape[1]) if mask[row, t]]
        rewards = [-coef * float(log_probs[row, t] - ref[row, t]) for t in positions]
        rewards[-1] += float(scores[row])
        running, next_value = 0.0, 0.0
        for i in reversed(range(len(positions))):
            t = positions[i]
            delta = rewards[i] + next_value - float(values[row, t])
            running = delta + 0.9 * running
            advantages[row, t] = running
            next_value = float(values[row, t])
    return advantages


def test_advantages_put_the_score_and_the_kl_penalty_into_gae() -> None:
    torch.manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    log_probs, ref, values = (torch.randn(2, 5) * mask for _ in range(3))
    scores = torch.tensor([1.0, -0.5])
    algorithm = AlgorithmConfig(gamma=1.0, lam=0.9, kl_coef=0.1, whiten_advantages=False)
    result = compute_advantages(scores, log_probs, ref, values, mask, algorithm)
    expected = naive_advantages(scores, log_probs, ref, values, mask, 0.1)
    torch.testing.assert_close(result.advantages, expected)
    torch.testing.assert_close(result.returns, (expected + values) * mask)
    torch.testing.assert_close(result.kl, (log_probs - ref) * mask)


def test_kl_as_a_loss_leaves_the_rewards_alone_and_whitening_applies() -> None:
    torch.manual_seed(1)
    mask = torch.ones(3, 4)
    log_probs, ref, values = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    scores = torch.tensor([1.0, 0.0, 0.5])
    algorithm = AlgorithmConfig(kl_mode="loss", lam=0.95)
    result = compute_advantages(scores, log_probs, ref, values, mask, algorithm)
    no_kl = torch.zeros(3, 4)
    no_kl[:, -1] = scores
    plain, _ = gae(no_kl, values, mask, 1.0, 0.95)
    torch.testing.assert_close(result.advantages, whiten(plain, mask))


def test_without_a_reference_there_is_no_kl() -> None:
    mask = torch.ones(2, 3)
    result = compute_advantages(
        torch.ones(2), torch.randn(2, 3), None, torch.zeros(2, 3), mask, AlgorithmConfig()
    )
    assert result.kl.abs().sum() == 0
    assert mean_kl(result.kl, mask) == 0


def test_mean_kl_sums_tokens_and_averages_responses() -> None:
    kl = torch.tensor([[0.5, 0.5, 9.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert mean_kl(kl, mask) == pytest.approx(1.0)


def test_minibatches_partition_the_rows() -> None:
    parts = minibatches(10, 4, torch.Generator().manual_seed(0))
    assert [len(p) for p in parts] == [4, 4, 2]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))


def test_micro_batches_hold_rows_of_similar_length_longest_first() -> None:
    lengths = [3, 9, 1, 7, 5, 9]
    mask = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    batch = Sequences(
        input_ids=torch.zeros_like(mask),
        attention_mask=mask,
        response_mask=torch.zeros(mask.shape),
        rollout_log_probs=torch.zeros(mask.shape),
        policy_version=torch.zeros(len(mask), dtype=torch.long),
    )
    groups = micro_batch_rows(batch, 4)
    assert [g.tolist() for g in groups] == [[1, 5, 3, 4], [0, 2]]
    assert [g.tolist() for g in micro_batch_rows(batch, None)] == [[1, 5, 3, 4, 0, 2]]


def test_micro_batches_reach_the_roles_device_and_results_come_back_to_the_batchs() -> None:
    """Ray hands a role its batch on the CPU; a role on a GPU computes there. (The meta
    device stands in for a GPU: no data, but a device of its own.)"""
    batch = pack_rollouts(
        [rollout([1, 5], [7]), rollout([1, 5], [8, 9, 2, 3]), rollout([1], [4])], PAD
    )
    devices: list[set[str]] = []

    def outputs(micro: Sequences) -> torch.Tensor:
        devices.append({t.device.type for t in micro.tensors().values()})
        return torch.ones(micro.input_ids.shape)

    result = per_token(batch, 2, outputs, torch.device("meta"))
    assert devices == [{"meta"}, {"meta"}]
    assert result.device.type == "cpu" and torch.equal(result, batch.response_mask)


def test_trimming_drops_the_columns_that_are_padding_in_every_row() -> None:
    batch = pack_rollouts(
        [rollout([1, 5], [7]), rollout([1, 5], [8, 9, 2, 3]), rollout([1], [4])], PAD
    )
    short, columns = batch.select(torch.tensor([0, 2])).trimmed()
    assert columns == slice(0, 3)
    assert short.input_ids.tolist() == [[1, 5, 7], [0, 1, 4]]
    assert short.response_mask.tolist() == [[0, 0, 1], [0, 0, 1]]
    assert short.policy_version.tolist() == [0, 0]
    only_the_short_prompt, columns = batch.select(torch.tensor([2])).trimmed()
    assert columns == slice(1, 3)
    assert only_the_short_prompt.input_ids.tolist() == [[1, 4]]


def test_the_prompt_stream_walks_epochs_in_a_seeded_order_and_resumes() -> None:
    prompts = [Prompt(str(i), [i]) for i in range(5)]
    stream = PromptStream(prompts, seed=3)
    first = [p.text for p in stream.next_batch(4)]
    second = [p.text for p in stream.next_batch(4)]
    assert sorted(first + second[:1]) == ["0", "1", "2", "3", "4"]  # one epoch, each once
    assert stream.position() == (1, 3)
    resumed = PromptStream(prompts, seed=3)
    resumed.seek(*stream.position())
    fresh = PromptStream(prompts, seed=3)
    fresh.next_batch(8)
    assert [p.text for p in resumed.next_batch(6)] == [p.text for p in fresh.next_batch(6)]
    assert PromptStream(prompts, seed=4).order(0) != stream.order(0)


def test_an_unshuffled_stream_keeps_the_file_order() -> None:
    stream = PromptStream([Prompt(str(i), [i]) for i in range(3)], seed=0, shuffle=False)
    assert [p.text for p in stream.next_batch(4)] == ["0", "1", "2", "0"]


def test_a_stream_refuses_a_position_outside_its_prompts() -> None:
    with pytest.raises(ValueError, match="outside"):
        PromptStream([Prompt("a", [1])], seed=0).seek(0, 2)


def test_reward_functions_resolve_by_name_or_module_path() -> None:
    assert reward_function(RewardSource(function="toy_copy")) is toy_copy
    assert reward_function(RewardSource(function="rlhf_trainer.data.tasks:toy_copy")) is toy_copy
    assert reward_function(RewardSource(path="/models/rm")) is None
    with pytest.raises(ValueError, match="not built in"):
        reward_function(RewardSource(function="nope"))


def test_split_list_keeps_order_and_balances() -> None:
    assert split_list([1, 2, 3, 4, 5], 3) == [[1, 2], [3, 4], [5]]
    assert split_list([1], 2) == [[1], []]


def test_max_abs_diff_counts_only_masked_tokens() -> None:
    a, b = torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.0, 0.0, 0.5]])
    assert max_abs_diff(a, b, torch.tensor([[1.0, 0.0, 1.0]])) == 0.5
    assert max_abs_diff(a, b, torch.zeros(1, 3)) == 0.0
