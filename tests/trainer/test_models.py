"""Tiny models, their tokenizer and the value model, built in code and saved to disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.data.tasks import copy_prompts, toy_copy
from rlhf_trainer.models import (
    EOS,
    ValueModel,
    build_tiny_model,
    build_tokenizer,
    token_log_probs,
    vocabulary,
    write_tiny_model,
)

TINY = TinyModel(hidden_size=64, num_layers=1, num_heads=2, vocab_size=64)


def test_vocabulary_fills_vocab_size_with_specials_first() -> None:
    for size in (16, 41, 64, 512):
        vocab = vocabulary(size)
        assert len(vocab) == len(set(vocab)) == size
        assert vocab[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert "z" in vocabulary(64) and "z" not in vocabulary(16)


def test_tokenizer_round_trips_a_prompt_and_its_ideal_response() -> None:
    tokenizer = build_tokenizer(64)
    prompt = copy_prompts(1, seed=0)[0]
    ids = tokenizer(prompt.text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 1
    assert len(ids) == 1 + len(prompt.text.split())
    response_ids = tokenizer(prompt.ideal_response, add_special_tokens=False)["input_ids"]
    assert response_ids[-1] == tokenizer.eos_token_id == 2
    assert tokenizer.decode(response_ids) == prompt.ideal_response
    assert toy_copy(prompt.text, tokenizer.decode(response_ids)) == 1.0
    assert tokenizer.decode(list(range(60, 64))) == "<extra_17> <extra_18> <extra_19> <extra_20>"


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_tiny_model_is_seeded_and_round_trips_through_a_directory(
    architecture: str, tmp_path: Path
) -> None:
    tiny = TINY.model_copy(update={"architecture": architecture})
    model = build_tiny_model(tiny, seed=3)
    assert model.config.model_type == architecture
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    assert model.config.tie_word_embeddings
    again = build_tiny_model(tiny, seed=3)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name

    write_tiny_model(tiny, tmp_path, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == tiny.vocab_size and tokenizer.eos_token == EOS
    ids = torch.tensor([tokenizer("a b c =")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_token_log_probs_ignore_left_padding() -> None:
    model = build_tiny_model(TINY, seed=0)
    ids = torch.tensor([[1, 10, 11, 12, 13]])
    padded = torch.tensor([[0, 0, 1, 10, 11, 12, 13]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        plain = token_log_probs(model, ids, torch.ones_like(ids))
        shifted = token_log_probs(model, padded, mask)
    torch.testing.assert_close(shifted[:, 2:], plain, atol=1e-5, rtol=0)
    assert plain[0, 0] == 0 and torch.all(plain[0, 1:] < 0)


def test_value_model_starts_at_zero_from_the_actor_backbone_and_learns(tmp_path: Path) -> None:
    write_tiny_model(TINY, tmp_path, seed=1)
    critic = ValueModel.from_pretrained(tmp_path)
    actor = AutoModelForCausalLM.from_pretrained(tmp_path)
    embeddings = actor.get_input_embeddings().weight
    torch.testing.assert_close(critic.backbone.get_input_embeddings().weight, embeddings)

    ids = torch.tensor([[0, 1, 10, 11], [1, 12, 13, 14]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    values = critic(ids, mask)
    assert values.shape == (2, 4) and torch.all(values == 0)

    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-2)
    target = torch.ones(2, 4)
    for _ in range(20):
        loss = ((critic(ids, mask) - target) ** 2 * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.05
