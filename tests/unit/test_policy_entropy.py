"""The loss's log-probs and entropy from one log-softmax (algo.ppo.log_probs_and_entropy)
are the two functions' apart, and the entropy keeps a graph only for an entropy bonus."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.algo import ppo

pytestmark = pytest.mark.unit


def case(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(2, 5, 11, generator=generator)
    return logits.requires_grad_(), torch.randint(0, 11, (2, 5), generator=generator)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_same_log_probs_and_entropy_as_apart(seed: int) -> None:
    logits, tokens = case(seed)
    log_probs, entropy = ppo.log_probs_and_entropy(logits, tokens)
    assert torch.equal(log_probs, ppo.log_probs_from_logits(logits, tokens))
    torch.testing.assert_close(entropy, ppo.entropy_from_logits(logits.detach()))
    assert log_probs.requires_grad and not entropy.requires_grad  # a report only


def test_an_entropy_bonus_gets_the_entropys_gradient() -> None:
    logits, tokens = case(3)
    _, entropy = ppo.log_probs_and_entropy(logits, tokens, entropy_grad=True)
    (mine,) = torch.autograd.grad(entropy.sum(), logits)
    (reference,) = torch.autograd.grad(ppo.entropy_from_logits(logits).sum(), logits)
    torch.testing.assert_close(mine, reference)
