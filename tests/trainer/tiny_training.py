"""A few optimizer steps of a tiny actor or critic: the same code sharded and unsharded.

The sharding and checkpoint tests compare a run on N ranks, each on its shard of the
global batch, with one plain process on the whole batch. The loss is a mean over the
shard and the shards are equal, so the mean of the ranks' losses is the global loss and
FSDP's averaging of the gradients over ranks must give the unsharded gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.models import ValueModel, build_tiny_model, token_log_probs
from rlhf_trainer.roles.sharding import clip_gradients

TINY = TinyModel(hidden_size=64, num_layers=2, num_heads=2, vocab_size=32)
Kind = Literal["actor", "critic"]
GLOBAL_BATCH = 4  # rows per step, split evenly over 1 or 2 ranks
SEQUENCE = 8
LEARNING_RATE = 1e-2
MAX_GRAD_NORM = 0.5  # below the tiny models' norms, so clipping is active


def build(kind: Kind, seed: int = 0) -> nn.Module:
    actor = build_tiny_model(TINY, seed=seed)
    if kind == "actor":
        return actor.train()
    critic = ValueModel(actor.model)
    # The real head starts at zero, which gives the backbone zero or tiny gradients in
    # the first steps; Adam divides them by their own size and so turns the float noise
    # of summing in another order into whole steps. A random head keeps them well scaled.
    nn.init.normal_(critic.value_head.weight, std=0.02)
    return critic.train()


def global_batch(step: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return {
        "input_ids": torch.randint(
            0, TINY.vocab_size, (GLOBAL_BATCH, SEQUENCE), generator=generator
        ),
        "attention_mask": torch.ones(GLOBAL_BATCH, SEQUENCE, dtype=torch.long),
        "targets": torch.rand(GLOBAL_BATCH, SEQUENCE, generator=generator),
    }


def rank_batch(step: int, rank: int, world_size: int) -> dict[str, Tensor]:
    return {name: torch.tensor_split(t, world_size)[rank] for name, t in global_batch(step).items()}


def loss(kind: Kind, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """A mean over the batch's tokens: negative log-likelihood, or the value error."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if kind == "actor":
        return -token_log_probs(model, ids, mask).mean()
    return ((model(ids, mask) - batch["targets"]) ** 2).mean()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)


def train_step(
    kind: Kind, model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Tensor]
) -> float:
    """One optimizer step; returns the gradient norm before clipping."""
    opt.zero_grad()
    loss(kind, model, batch).backward()
    norm = clip_gradients(model, MAX_GRAD_NORM)
    opt.step()
    return norm


def assert_state_dicts_close(
    actual: dict[str, Tensor], expected: dict[str, Tensor], atol: float, rtol: float = 0.0
) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, atol=atol, rtol=rtol, msg=name)
