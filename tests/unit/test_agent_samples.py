"""An agent episode as the loop takes it (rollout.agent_episodes.AgentEpisode): the row's
sample is the one holding its last call, carrying the episode's other samples (the
latest, up to maxSamplesPerEpisode) with their shares of the reward; the rest counted as
left out; a masked episode keeps its own sample only; an episode without a call is a
masked placeholder cut with a reason of its own; a limit's cut policy may train it."""

from __future__ import annotations

from rlhf_trainer.api.cuts import AgentCutPolicies, CutPolicy
from rlhf_trainer.gateway.records import MAX_CALLS, CallRecord, EpisodeRecords, SampledChoice
from rlhf_trainer.rollout.agent_episodes import NO_CALLS, AgentEpisode

DISCOUNT = 0.5


def choice(ids: list[int]) -> SampledChoice:
    return SampledChoice(0, ids, [-0.5] * len(ids), ((3, 0),), "stop")


def episode(
    calls: list[CallRecord], reward: float = 1.0, cut: str | None = None, trains: bool = False
) -> AgentEpisode:
    records = EpisodeRecords(tuple(calls), cut, {MAX_CALLS: 1} if cut == MAX_CALLS else {})
    return AgentEpisode.of(records, reward, DISCOUNT, cut, trains)


def edited_history() -> list[CallRecord]:
    """Three samples: each call edits the history (extends no earlier call)."""
    return [CallRecord(i, [1, 5 + i, 2], (choice([7 + i, 3]),)) for i in range(3)]


def test_an_extending_episode_trains_its_one_sample_and_leaves_nothing_out() -> None:
    first = CallRecord(0, [1, 5, 2], (choice([7, 3]),))
    second = CallRecord(1, [1, 5, 2, 7, 3, 9, 2], (choice([8, 3]),))
    ended = episode([first, second], reward=2.0)
    trained = ended.trained(version=9, max_samples=4)
    assert trained.response_token_ids == [7, 3, 9, 2, 8, 3]
    assert trained.loss_mask == (1, 1, 0, 0, 1, 1) and trained.others == ()
    assert trained.episode is not None and trained.episode.score == 2.0
    tally = ended.tally(max_samples=4)
    assert (tally.cut, tally.calls, tally.samples_left_out) == (None, 2, 0)
    assert (tally.prompt_tokens, tally.sampled_tokens) == (3 + 7, 4)


def test_the_row_is_the_last_calls_sample_carrying_the_others_with_their_shares() -> None:
    # The second call edits the history (extends nothing); the third extends the first.
    first = CallRecord(0, [1, 5, 2], (choice([7, 3]),))
    edited = CallRecord(1, [1, 6, 2], (choice([8, 3]),))
    third = CallRecord(2, [1, 5, 2, 7, 3, 9, 2], (choice([4, 3]),))
    ended = episode([first, edited, third], reward=2.0)
    assert len(ended.rollouts) == 2 and ended.latest == [0, 1]  # the first holds call 2
    trained = ended.trained(version=9, max_samples=4)
    assert trained.response_token_ids[-2:] == [4, 3]
    assert trained.episode is not None and trained.episode.score == 2.0  # discount**0
    (other,) = trained.others
    assert other.rollout.prompt_token_ids == [1, 6, 2] and other.share == DISCOUNT
    assert other.rollout.loss_mask == (1, 1)  # trained on
    assert ended.tally(max_samples=4).samples_left_out == 0


def test_past_max_samples_the_latest_are_kept_and_the_earlier_left_out() -> None:
    ended = episode(edited_history(), reward=1.0)
    trained = ended.trained(version=9, max_samples=2)
    assert trained.prompt_token_ids == [1, 7, 2]  # the last call's
    assert [(o.rollout.prompt_token_ids, o.share) for o in trained.others] == [([1, 6, 2], 0.5)]
    assert ended.tally(max_samples=2).samples_left_out == 1
    whole = ended.trained(version=9, max_samples=3)  # earliest first, each with its share
    assert [(o.rollout.prompt_token_ids, o.share) for o in whole.others] == [
        ([1, 5, 2], 0.25),
        ([1, 6, 2], 0.5),
    ]
    assert episode(edited_history()).trained(9, max_samples=1).others == ()


def test_a_cut_episode_trains_nothing_keeps_its_reason_and_only_its_own_sample() -> None:
    ended = episode(edited_history(), cut=MAX_CALLS)
    trained = ended.trained(version=9, max_samples=4)
    assert trained.loss_mask == (0, 0) and trained.episode is not None and trained.others == ()
    assert trained.episode.cut == MAX_CALLS and trained.episode.score == 0.0
    tally = ended.tally(max_samples=4)
    assert tally.cut == MAX_CALLS and tally.refusals == {MAX_CALLS: 1}
    assert tally.samples_left_out == 2


def test_a_cut_its_policy_trains_trains_every_sample_with_the_policys_score() -> None:
    ended = episode(edited_history(), reward=-1.0, cut=MAX_CALLS, trains=True)
    trained = ended.trained(version=9, max_samples=4)
    assert trained.loss_mask == (1, 1) and trained.episode is not None
    assert trained.episode.cut == MAX_CALLS and trained.episode.score == -1.0
    assert [o.rollout.loss_mask for o in trained.others] == [(1, 1), (1, 1)]
    assert [o.share for o in trained.others] == [0.25, 0.5]


def test_agent_cut_policies_set_the_limits_and_mask_the_agents_faults() -> None:
    policies = AgentCutPolicies.model_validate(
        {"maxCalls": {"policy": "train", "score": -1}, "episodeTimeout": {"policy": "train"}}
    )
    assert policies.of(MAX_CALLS) == CutPolicy(policy="train", score=-1)
    assert policies.of("episode_timeout").trains and policies.of("episode_timeout").reward == 0
    assert not policies.of("max_call_tokens").trains  # unset: masked, as before
    for fault in ("agent_error: boom", "agent_unreachable", "agent_timeout", NO_CALLS):
        assert not policies.of(fault).trains
    assert not AgentCutPolicies().of(MAX_CALLS).trains


def test_an_episode_without_a_call_is_a_masked_placeholder_cut_as_such() -> None:
    ended = episode([], reward=1.0)
    trained = ended.trained(version=9, max_samples=4)
    assert trained.response_token_ids == [] and len(trained.prompt_token_ids) == 1
    assert trained.policy_version == 9 and trained.episode is not None
    assert trained.episode.cut == NO_CALLS and trained.episode.score == 0.0
    assert ended.tally(4).cut == NO_CALLS and ended.tally(4).samples_left_out == 0
    # An agent that failed before calling keeps its own reason.
    failed = episode([], cut="agent_unreachable: refused")
    assert failed.trained(0, 4).episode.cut.startswith("agent_unreachable")  # type: ignore[union-attr]
    assert failed.tally(4).cut == "agent_unreachable: refused"
