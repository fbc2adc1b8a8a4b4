"""v1's one trained sample per agent episode (rollout.agent_episodes.AgentEpisode): the
sample holding its last call, its other samples counted as left out, an episode without
a call a masked placeholder cut with a reason of its own."""

from __future__ import annotations

from rlhf_trainer.gateway.merge import episode_rollouts
from rlhf_trainer.gateway.records import MAX_CALLS, CallRecord, EpisodeRecords, SampledChoice
from rlhf_trainer.rollout.agent_episodes import NO_CALLS, AgentEpisode, last_sample


def choice(ids: list[int]) -> SampledChoice:
    return SampledChoice(0, ids, [-0.5] * len(ids), ((3, 0),), "stop")


def episode(calls: list[CallRecord], reward: float = 1.0, cut: str | None = None) -> AgentEpisode:
    records = EpisodeRecords(tuple(calls), cut, {MAX_CALLS: 1} if cut == MAX_CALLS else {})
    rollouts = episode_rollouts(calls, reward, 0.5, cut)
    return AgentEpisode(rollouts, records, cut, last_sample(calls))


def test_an_extending_episode_trains_its_one_sample_and_leaves_nothing_out() -> None:
    first = CallRecord(0, [1, 5, 2], (choice([7, 3]),))
    second = CallRecord(1, [1, 5, 2, 7, 3, 9, 2], (choice([8, 3]),))
    ended = episode([first, second], reward=2.0)
    trained = ended.trained(version=9)
    assert trained.response_token_ids == [7, 3, 9, 2, 8, 3]
    assert trained.loss_mask == (1, 1, 0, 0, 1, 1)
    assert trained.episode is not None and trained.episode.score == 2.0
    tally = ended.tally()
    assert (tally.cut, tally.calls, tally.samples_left_out) == (None, 2, 0)
    assert (tally.prompt_tokens, tally.sampled_tokens) == (3 + 7, 4)


def test_the_sample_holding_the_last_call_is_trained_the_others_left_out() -> None:
    # The second call edits the history (extends nothing); the third extends the first.
    first = CallRecord(0, [1, 5, 2], (choice([7, 3]),))
    edited = CallRecord(1, [1, 6, 2], (choice([8, 3]),))
    third = CallRecord(2, [1, 5, 2, 7, 3, 9, 2], (choice([4, 3]),))
    ended = episode([first, edited, third], reward=2.0)
    assert len(ended.rollouts) == 2 and ended.last == 0  # the first sample holds call 2
    trained = ended.trained(version=9)
    assert trained.response_token_ids[-2:] == [4, 3]
    assert trained.episode is not None and trained.episode.score == 2.0  # discount**0
    assert ended.tally().samples_left_out == 1


def test_a_cut_episode_trains_nothing_and_keeps_its_reason() -> None:
    ended = episode([CallRecord(0, [1, 5, 2], (choice([7, 3]),))], cut=MAX_CALLS)
    trained = ended.trained(version=9)
    assert trained.loss_mask == (0, 0) and trained.episode is not None
    assert trained.episode.cut == MAX_CALLS and trained.episode.score == 0.0
    assert ended.tally().cut == MAX_CALLS and ended.tally().refusals == {MAX_CALLS: 1}


def test_an_episode_without_a_call_is_a_masked_placeholder_cut_as_such() -> None:
    ended = episode([], reward=1.0)
    trained = ended.trained(version=9)
    assert trained.response_token_ids == [] and len(trained.prompt_token_ids) == 1
    assert trained.policy_version == 9 and trained.episode is not None
    assert trained.episode.cut == NO_CALLS and trained.episode.score == 0.0
    assert ended.tally().cut == NO_CALLS and ended.tally().samples_left_out == 0
    # An agent that failed before calling keeps its own reason.
    failed = episode([], cut="agent_unreachable: refused")
    assert failed.trained(version=0).episode.cut.startswith("agent_unreachable")  # type: ignore[union-attr]
    assert failed.tally().cut == "agent_unreachable: refused"
