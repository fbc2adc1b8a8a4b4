"""The weight-sync helpers of the rollout engine, without starting vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rlhf_trainer.algo.experience import tokens_per_version
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.rollout.engine_weights import refresh_tied_lm_head, rollout_state_dict
from rlhf_trainer.rollout.transfer_engines import PolicySource

TINY = TinyModel(hidden_size=64, num_layers=1, num_heads=2, vocab_size=32)


def test_state_dict_for_the_engine_leaves_out_a_tied_lm_head() -> None:
    model = build_tiny_model(TINY)
    weights = rollout_state_dict(model)
    assert "lm_head.weight" not in weights
    assert "model.embed_tokens.weight" in weights
    model.config.tie_word_embeddings = False
    assert "lm_head.weight" in rollout_state_dict(model)


def test_the_policy_source_declares_and_sends_what_the_engine_loads_in_its_dtype() -> None:
    model = build_tiny_model(TINY)
    source = PolicySource(model, tied=True, dtype=torch.bfloat16)
    expected = rollout_state_dict(model)
    declared = [(m.name, m.dtype, m.shape) for m in source.metadata()]
    assert declared == [(n, torch.bfloat16, tuple(t.shape)) for n, t in expected.items()]
    for _ in range(2):  # a fresh pass each push
        sent = dict(source)
        assert sent.keys() == expected.keys()
        for name, tensor in sent.items():
            assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    grouped = [name for names, _ in source.iter_groups() for name in names]
    assert sorted(grouped) == sorted(expected), "vLLM's layer groups cover every weight"


def test_a_push_waits_for_the_optimizer_step_before_its_first_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU the optimizer step is queued on the rank's stream, and vLLM's packed NCCL
    sender gathers on side streams of its own that wait for nothing: the source syncs the
    device before it yields (and so gathers) its first tensor. STAND-IN: torch.cuda's
    is_available and synchronize (no GPU here)."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("synchronize"))
    source = PolicySource(build_tiny_model(TINY), tied=True, dtype=torch.float32)
    for name, _ in source:
        events.append(name)
    assert events[0] == "synchronize" and events.count("synchronize") == 1
    assert len(events) == 1 + len(source.metadata())


class FakeVllmModel(nn.Module):
    """vLLM's layout: model.embed_tokens, and an lm_head with a quant_method."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(8, 4)
        self.lm_head = nn.Module()
        self.lm_head.weight = (
            self.model.embed_tokens.weight if tied else nn.Parameter(torch.zeros(8, 4))
        )
        self.processed: list[nn.Module] = []
        self.lm_head.quant_method = SimpleNamespace(
            process_weights_after_loading=self.processed.append
        )


def test_a_tied_lm_head_is_reprocessed_after_a_reload_and_an_untied_one_is_not() -> None:
    tied = FakeVllmModel(tied=True)
    assert refresh_tied_lm_head(tied)
    assert tied.processed == [tied.lm_head]
    untied = FakeVllmModel(tied=False)
    assert not refresh_tied_lm_head(untied)
    assert untied.processed == []


def test_a_tied_lm_head_takes_the_kernel_the_reload_packed_for_the_embeddings() -> None:
    """On CPU the embeddings' post-load step packs the shared weight (`cpu_linear`): the
    head takes that kernel and packs nothing again (real vLLM: test_rollout_vllm.py's
    log-probs after a weight update)."""
    tied = FakeVllmModel(tied=True)
    tied.model.embed_tokens.cpu_linear = kernel = object()
    assert refresh_tied_lm_head(tied)
    assert tied.lm_head.cpu_linear is kernel
    assert tied.processed == []


def test_tokens_per_version_counts_each_span() -> None:
    assert tokens_per_version(((3, 0), (4, 5)), 9) == {3: 5, 4: 4}
    assert tokens_per_version(((3, 0),), 7) == {3: 7}
    assert tokens_per_version(((1, 0), (2, 1), (3, 2)), 3) == {1: 1, 2: 1, 3: 1}
    assert tokens_per_version((), 0) == {}
    # A version that comes back (weights reloaded) adds up.
    assert tokens_per_version(((1, 0), (2, 2), (1, 5)), 6) == {1: 3, 2: 3}


@pytest.mark.parametrize(
    ("spans", "num_tokens"),
    [
        (((3, 1),), 4),  # does not start at token 0
        ((), 2),  # tokens with no version
        (((3, 0), (4, 3), (5, 3)), 6),  # an empty span
        (((3, 0), (4, 5)), 4),  # a span past the end
    ],
)
def test_tokens_per_version_rejects_spans_that_do_not_fit(
    spans: tuple[tuple[int, int], ...], num_tokens: int
) -> None:
    with pytest.raises(ValueError, match="version spans"):
        tokens_per_version(spans, num_tokens)
