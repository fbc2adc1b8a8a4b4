"""An agent episode's calls merged into samples (gateway.merge), against a naive reference,
and the gateway's episode book: its key, limits and cuts (gateway.records)."""

from __future__ import annotations

import random

import pytest

from rlhf_trainer.gateway.merge import episode_rollouts, merge_calls, sample_rewards
from rlhf_trainer.gateway.records import (
    EPISODE_TIMEOUT,
    MAX_CALL_TOKENS,
    MAX_CALLS,
    CallLimits,
    CallRecord,
    EpisodeBook,
    Refused,
    SampledChoice,
)


def choice(ids: list[int], version: int = 0, index: int = 0, finish: str = "stop") -> SampledChoice:
    log_probs = [-0.5 - 0.01 * i for i in ids]
    return SampledChoice(index, ids, log_probs, ((version, 0),), finish)


def test_a_call_that_extends_the_last_one_continues_its_sample() -> None:
    first = CallRecord(0, [1, 5, 6, 2], (choice([7, 8, 3], version=4),))
    # the template's glue, a tool message and the next generation prompt: 9 9 2
    second = CallRecord(1, [1, 5, 6, 2, 7, 8, 3, 9, 9, 2], (choice([10, 3], version=5),))
    (sample,) = merge_calls([first, second])
    trajectory = sample.trajectory
    assert trajectory.token_ids == [1, 5, 6, 2, 7, 8, 3, 9, 9, 2, 10, 3]
    assert trajectory.loss_mask == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    assert trajectory.versions == [4, 5]
    assert sample.spans == [(4, 0), (5, 6)]
    (rollout,) = episode_rollouts([first, second], reward=1.0, discount=0.5)
    assert rollout.response_token_ids == [7, 8, 3, 9, 9, 2, 10, 3]
    assert rollout.response_log_probs[3:6] == [0.0, 0.0, 0.0]
    assert rollout.version_spans == ((4, 0), (5, 6)) and rollout.policy_version == 4
    assert rollout.episode is not None and rollout.episode.score == 1.0
    assert rollout.episode.turns == 2 and rollout.finished


def test_a_call_that_edits_its_history_starts_a_sample_of_its_own() -> None:
    first = CallRecord(0, [1, 5, 6, 2], (choice([7, 8, 3]),))
    edited = CallRecord(1, [1, 11, 6, 2, 7, 8, 3, 9, 2], (choice([10, 3]),))  # system edited
    samples = merge_calls([first, edited])
    assert [s.token_ids for s in samples] == [
        [1, 5, 6, 2, 7, 8, 3],
        [1, 11, 6, 2, 7, 8, 3, 9, 2, 10, 3],
    ]
    assert samples[1].trajectory.loss_mask == [0] * 9 + [1, 1]  # the edited copy is observed
    rollouts = episode_rollouts([first, edited], reward=2.0, discount=0.5)
    assert [r.episode.score for r in rollouts if r.episode] == [1.0, 2.0]


def test_a_cut_episode_is_not_trained_on() -> None:
    calls = [CallRecord(0, [1, 5, 2], (choice([7, 3]),))]
    (rollout,) = episode_rollouts(calls, reward=1.0, discount=1.0, cut=MAX_CALLS)
    assert rollout.loss_mask == (0, 0) and rollout.episode and rollout.episode.score == 0.0
    assert rollout.episode.cut == MAX_CALLS and not rollout.finished


def reference(calls: list[CallRecord]) -> list[tuple[list[int], list[int], list[float], list[int]]]:
    """Naively: chain each choice to the longest earlier chain whose full ids prefix its
    prompt, then lay each chain out from its last call's prompt, marking every member's
    sampled positions. (ids, mask, log-probs, versions) per chain."""
    chains: list[list[tuple[CallRecord, SampledChoice]]] = []

    def ids_of(chain: list[tuple[CallRecord, SampledChoice]]) -> list[int]:
        call, last = chain[-1]
        return call.prompt_ids + last.ids

    for call in calls:
        for c in call.choices:
            if not c.ids:
                continue
            fits = [ch for ch in chains if call.prompt_ids[: len(ids_of(ch))] == ids_of(ch)]
            fits = [ch for ch in fits if len(ids_of(ch)) <= len(call.prompt_ids)]
            if fits:
                longest = max(len(ids_of(ch)) for ch in fits)
                [ch for ch in fits if len(ids_of(ch)) == longest][-1].append((call, c))
            else:
                chains.append([(call, c)])
    laid_out = []
    for chain in chains:
        ids = ids_of(chain)
        mask, log_probs = [0] * len(ids), [0.0] * len(ids)
        for call, c in chain:
            start = len(call.prompt_ids)
            for offset, (token_log_prob) in enumerate(c.log_probs):
                mask[start + offset] = 1
                log_probs[start + offset] = token_log_prob
        laid_out.append((ids, mask, log_probs, [c.version for _, c in chain]))
    return laid_out


def random_episode(rng: random.Random) -> list[CallRecord]:
    """Calls that mostly extend an earlier call's ids (glue of 0-3 tokens), sometimes edit
    or drop the history, sometimes sample n > 1 choices; tokens from a tiny vocabulary so
    that accidental prefixes happen too."""
    calls: list[CallRecord] = []
    seen: list[list[int]] = []  # every choice's full ids so far
    for index in range(rng.randint(1, 8)):
        if seen and rng.random() < 0.7:
            base = list(rng.choice(seen))
            prompt = base + [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        else:
            prompt = [rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
        choices = tuple(
            choice([rng.randint(0, 3) for _ in range(rng.randint(0, 3))], rng.randint(0, 2), i)
            for i in range(rng.choice([1, 1, 1, 2]))
        )
        calls.append(CallRecord(index, prompt, choices))
        seen += [prompt + c.ids for c in choices]
    return calls


@pytest.mark.parametrize("seed", range(300))
def test_merge_matches_the_naive_reference(seed: int) -> None:
    calls = random_episode(random.Random(seed))
    merged = merge_calls(calls)
    expected = reference(calls)
    got = [
        (s.token_ids, s.trajectory.loss_mask, s.trajectory.log_probs, s.trajectory.versions)
        for s in merged
    ]
    assert got == expected
    sampled = sum(len(c.ids) for call in calls for c in call.choices)
    assert sum(sum(mask) for _, mask, _, _ in got) == sampled  # every sampled token once


def test_rewards_are_discounted_from_the_last_sample() -> None:
    calls = [CallRecord(i, [20 + i], (choice([i]),)) for i in range(3)]  # none extends
    samples = merge_calls(calls)
    assert sample_rewards(samples, 2.0, 0.5) == [0.5, 1.0, 2.0]
    assert sample_rewards(samples, 2.0, 1.0) == [2.0, 2.0, 2.0]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def refusal(book: EpisodeBook, key: str | None, max_tokens: int | None = None) -> Refused:
    with pytest.raises(Refused) as refused:
        book.admit(key, max_tokens)
    return refused.value


def test_the_book_binds_calls_by_key_and_enforces_the_limits() -> None:
    clock = Clock()
    book = EpisodeBook(clock)
    book.open("k1", CallLimits(max_calls=2, max_call_tokens=8, episode_seconds=10))
    unknown = refusal(book, "nope")
    assert unknown.status == 401 and unknown.body()["error"]["code"] == "invalid_api_key"
    assert set(unknown.body()["error"]) == {"message", "type", "param", "code"}
    assert refusal(book, None).status == 401
    assert book.admit("k1", None) == (0, 8)  # unset max_tokens: the limit
    assert book.admit("k1", 4) == (1, 4)
    past = refusal(book, "k1", 4)
    assert past.status == 403 and past.code == MAX_CALLS and "2 calls" in str(past)
    book.record("k1", "r", CallRecord(0, [1], (choice([2]),)))
    records, in_flight = book.close("k1")
    assert records.cut == MAX_CALLS and records.refusals == {MAX_CALLS: 1}
    assert len(records.calls) == 1 and in_flight == []
    assert refusal(book, "k1").status == 401  # closed: the key is gone

    book.open("k2", CallLimits(max_calls=5, max_call_tokens=8, episode_seconds=10))
    greedy = refusal(book, "k2", 9)
    assert greedy.code == MAX_CALL_TOKENS and greedy.param == "max_tokens"
    assert refusal(book, "k2", 1).code == MAX_CALL_TOKENS  # cut: every later call refused

    book.open("k3", CallLimits(max_calls=5, max_call_tokens=8, episode_seconds=10))
    book.admit("k3", 1)
    clock.now = 10.0  # the deadline passes
    assert refusal(book, "k3", 1).code == EPISODE_TIMEOUT
    book.started("k3", "agent-7")
    assert book.close("k3")[1] == ["agent-7"]  # in flight: the caller aborts it


def test_a_closed_episode_is_counted_in_rlhf_agent_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from rlhf_trainer.telemetry.metrics import AgentMetrics

    book = EpisodeBook(Clock())
    book.open("k", CallLimits(max_calls=1, max_call_tokens=8, episode_seconds=10))
    book.admit("k", 2)
    book.record("k", "r", CallRecord(0, [1, 5, 2], (choice([7, 3]),)))
    refusal(book, "k", 2)
    records, _ = book.close("k")
    registry = CollectorRegistry()
    AgentMetrics(registry).count_episode(
        records.cut,
        len(records.calls),
        records.refusals,
        records.prompt_tokens,
        records.sampled_tokens,
    )
    value = registry.get_sample_value
    assert value("rlhf_agent_episodes_total", {"outcome": MAX_CALLS}) == 1
    assert value("rlhf_agent_calls_total") == 1
    assert value("rlhf_agent_refusals_total", {"reason": MAX_CALLS}) == 1
    assert value("rlhf_agent_tokens_total", {"kind": "prompt"}) == 3
    assert value("rlhf_agent_tokens_total", {"kind": "sampled"}) == 2


def test_a_continued_conversation_keeps_the_sampled_ids() -> None:
    from rlhf_trainer.gateway.exact import Contexts
    from tests.chat_families import qwen, tokenizer_of

    tokenizer = tokenizer_of(qwen(template="qwen2_5"))
    contexts = Contexts(tokenizer)
    contexts.open("k")
    prompt_text = "<|im_start|>user\nWhat is lime?<|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer.encode(prompt_text)
    # "green" sampled letter by letter: its text encodes as fewer, other ids.
    sampled = [*tokenizer.convert_tokens_to_ids(list("green")), tokenizer.eos_token_id]
    assert tokenizer.encode("green<|im_end|>") != sampled
    contexts.add("k", prompt_text, prompt, sampled)
    glue = "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    text = prompt_text + "green<|im_end|>" + glue
    exact = contexts.prompt_ids("k", text, tokenizer.encode(text))
    assert exact == prompt + sampled + tokenizer.encode(glue)
    # Bytes cut mid-character decode as U+FFFD, whichever side held them back.
    first_byte = tokenizer.convert_tokens_to_ids("â")  # byte-level BPE's byte 0xE2
    cut = [*prompt, *tokenizer.encode("gre"), first_byte]
    contexts.add("k", prompt_text, prompt, cut[len(prompt) :])
    held_back = prompt_text + "gre<|im_end|>" + glue
    assert contexts.prompt_ids("k", held_back, [7]) == cut + tokenizer.encode("<|im_end|>" + glue)
    edited = text.replace("lime", "lemon")  # the history changed: vLLM's ids stand
    assert contexts.prompt_ids("k", edited, [7, 7]) == [7, 7]
    contexts.close("k")
    assert contexts.prompt_ids("k", text, [7]) == [7]
