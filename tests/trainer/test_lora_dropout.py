"""LoRA dropout and PPO (`models.actor.lora.dropout`): π_old, the ref and the engines
compute π without dropout, so the loss's π_θ (the model in train mode) must too, or the
ratio π_θ / π_old is not 1 at identical weights and the clip bites on noise. The actor
runs every forward with dropout off; its first π_old, before any update, is the same
every time it is asked (peft builds its dropout layers in train mode).

One gloo rank, a tiny model, dropout 0.5: ~10 s.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf_trainer.algo.experience import Experience
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.roles.policy import Actor, sequence_log_probs, without_dropout
from rlhf_trainer.worker import RankInfo
from tests.specs import local_job
from tests.trainer.distributed import run_ranks
from tests.trainer.test_roles import ROWS, experience

DROPOUT = 0.5


def dropout_job(gradient_checkpointing: bool) -> JobConfig:
    """The local example's actor LoRA'd with dropout, one rank, no checkpoints."""
    job = local_job(colocated=True, total_steps=1, checkpoint_dir=Path("/unused"), every_steps=1)
    spec = job.model_dump(by_alias=True, exclude_none=True)
    spec["pools"][0]["gpusPerNode"] = 1
    spec["models"]["actor"]["tiny"] |= {"hiddenSize": 64, "numHeads": 2}
    spec["models"]["actor"]["lora"] = {"rank": 8, "alpha": 16, "dropout": DROPOUT}
    spec["trainer"] |= {"miniBatchSize": ROWS, "batchSize": ROWS}
    spec["trainer"]["gradientCheckpointing"] = gradient_checkpointing
    del spec["trainer"]["checkpoint"]["path"]
    return JobConfig.model_validate(spec)


def ratios(rank: int, job: JobConfig) -> dict[str, torch.Tensor]:
    """π_old asked twice of an actor with a trained adapter, and the loss's own log-probs (train mode, as
    `Trainable.update` runs it) on the same weights, with its statistics."""
    actor = Actor(RankInfo(Role.ACTOR, "policy", rank, 1), job)
    with torch.no_grad():  # a trained adapter: B = 0 (a fresh one) would hide dropout
        for name, parameter in actor.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    batch = experience()
    first, second = actor.log_probs(batch), actor.log_probs(batch)
    micro: Experience = replace(batch, old_log_probs=first, rollout_log_probs=first)
    actor.model.train()
    new = sequence_log_probs(actor.model, batch, job, torch.device("cpu"))
    _, stats = actor.loss(micro, normalizer=batch.response_mask.sum())
    return {
        "first": first,
        "second": second,
        "new": new,
        "mask": batch.response_mask,
        "approx_kl": torch.tensor(stats["approx_kl"]),
        "clip_fraction": torch.tensor(stats["clip_fraction"]),
    }


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_the_ratio_is_one_at_identical_weights_with_lora_dropout_on(
    gradient_checkpointing: bool,
) -> None:
    (got,) = run_ranks(ratios, 1, dropout_job(gradient_checkpointing))
    mask = got["mask"].bool()
    # The first π_old is not a draw of peft's dropout: asked again, the same.
    torch.testing.assert_close(got["first"], got["second"], rtol=0, atol=0)
    log_ratio = (got["new"] - got["first"])[mask]
    assert log_ratio.abs().max() < 1e-5, log_ratio.abs().max()
    assert float(got["approx_kl"]) < 1e-8
    assert float(got["clip_fraction"]) == 0.0


def test_a_models_own_dropout_is_off_in_the_actor_too() -> None:
    """A full fine-tune's model with dropout in its config (attention_dropout, read by HF
    attention in train mode) answers in train mode as in eval mode once the actor has it."""
    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, attention_dropout=0.5)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(model.train()(tokens).logits, model.eval()(tokens).logits)
        model = without_dropout(model)
        torch.testing.assert_close(
            model.train()(tokens).logits, model.eval()(tokens).logits, rtol=0, atol=0
        )
