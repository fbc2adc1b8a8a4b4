"""The exports served by the command they are written with (their README.md), as written:
vLLM's own serve parser reads it, and its LLM on CPU loads the export, the tokenizer the
command names and, for an adapter, --max-lora-rank and the adapter, then answers text
prompts greedily. The text it appends is the actor's, decoded by the actor's tokenizer
(issue 74: `vllm serve` of the demo's export decoded 'c a f e =' as 'cafe=', and the
example's rank-32 adapter was refused). vLLM starts once per test: ~30 s each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from rlhf_trainer.api.sections import TrainedModel
from rlhf_trainer.models import build_tiny_model, build_tokenizer, write_tiny_model
from rlhf_trainer.roles.hf_export import write_policy
from rlhf_trainer.roles.hf_serve import BASE_PLACEHOLDER, SERVE_FILE
from rlhf_trainer.roles.lora import with_adapter
from tests.exports import actor_greedy, vllm_serve_text

pytestmark = pytest.mark.slow  # vLLM starts in each test

TINY = {"vocabSize": 64, "hiddenSize": 64, "numHeads": 2}
PROMPTS = ["c a f e =", "a b =", "x y z 1 2 =", "call result q ="]
MAX_TOKENS = 8
EOS = 2
SCALE = 5.0  # the tiny model's weights x5: varied answers (at x1 it answers "= = =")


def appended_text(model: torch.nn.Module, prompts: list[str]) -> list[str]:
    """The text the actor's greedy answers append to each prompt, as its own tokenizer
    decodes them (specials skipped): decode(prompt + answer) after decode(prompt)."""
    tokenizer = build_tokenizer(TINY["vocabSize"])
    encoded = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    answers = actor_greedy(model, encoded, MAX_TOKENS, EOS)  # type: ignore[arg-type]
    texts = []
    for prompt, answer in zip(encoded, answers, strict=True):
        before = tokenizer.decode(prompt, skip_special_tokens=True)
        whole = tokenizer.decode(prompt + answer, skip_special_tokens=True)
        assert whole.startswith(before)
        texts.append(whole[len(before) :])
    return texts


def scaled_policy(actor: TrainedModel) -> PreTrainedModel:
    assert actor.tiny is not None
    model = build_tiny_model(actor.tiny, seed=0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" not in name:
                weight.mul_(SCALE)
    return model


def test_the_default_export_served_as_written_appends_the_actors_text(tmp_path: Path) -> None:
    actor = TrainedModel.model_validate({"tiny": TINY})
    model = scaled_policy(actor)
    done = write_policy(model.state_dict(), actor, tmp_path / "model", None, 1, "test", seed=0)
    assert done.dtype == "bf16"
    assert done.serve in (tmp_path / "model" / SERVE_FILE).read_text()
    expected = appended_text(model.to(torch.bfloat16), PROMPTS)
    assert len(set(expected)) == len(PROMPTS) and any("<extra_" in t for t in expected), expected
    assert vllm_serve_text(done.serve, PROMPTS, MAX_TOKENS) == expected


def test_a_rank_32_adapter_served_as_written_appends_the_actors_text(tmp_path: Path) -> None:
    lora = {"rank": 32, "alpha": 64, "targetModules": ["q_proj", "v_proj"]}
    actor = TrainedModel.model_validate({"tiny": TINY, "lora": lora})
    assert actor.tiny is not None and actor.lora is not None
    policy = with_adapter(build_tiny_model(actor.tiny, seed=0), actor.lora).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B = 0 would serve the base: an update that changes answers
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator))
    trained = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    done = write_policy(trained, actor, tmp_path / "adapter", "fp32", 1, "test", seed=0,
                        adapter=True)  # fmt: skip
    assert "--max-lora-rank 32" in done.serve and "--dtype float32" in done.serve
    base = write_tiny_model(actor.tiny, tmp_path / "base", seed=0)  # as the README says
    command = done.serve.replace(f" {BASE_PLACEHOLDER} ", f" {base} ")
    expected = appended_text(policy, PROMPTS)
    assert expected != appended_text(build_tiny_model(actor.tiny, seed=0), PROMPTS)
    assert vllm_serve_text(command, PROMPTS, MAX_TOKENS) == expected
