"""The export is the policy that trained: a short local run's last checkpoint, exported,
gives the logits of the checkpoint's actor weights in the project's own model class (read
back through torch's own DCP converter, not the export's reader); the step-earlier
checkpoint's export does not, so the comparison can fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import Tensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.export import export_checkpoint
from rlhf_trainer.models import build_tiny_model, build_tokenizer, position_ids
from rlhf_trainer.roles import checkpoint
from tests.specs import local_job
from tests.trainer.local_runs import train

pytestmark = pytest.mark.slow  # trains a short run

STEPS = 3  # checkpoints at steps 2 and 3
PROMPTS = ["c a f e =", "b a d =", "f a c e d =", "a b c d e f ="]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> JobConfig:
    root = tmp_path_factory.mktemp("checkpoints")
    config = local_job(colocated=True, total_steps=STEPS, checkpoint_dir=root, every_steps=2)
    train(config)
    return config


def actor_at(config: JobConfig, step_dir: Path, scratch: Path) -> PreTrainedModel:
    """The checkpoint's actor weights in the project's own model class."""
    assert config.models.actor.tiny is not None
    model = build_tiny_model(config.models.actor.tiny, seed=1234)  # weights replaced below
    dcp_to_torch_save(step_dir / "actor", scratch / "actor.pt")
    saved = torch.load(scratch / "actor.pt", weights_only=False)["model"]
    model.load_state_dict(saved, strict=True)
    return model.eval()


def logits(model: PreTrainedModel, vocab_size: int) -> Tensor:
    """(B, T, V) logits on the prompts, left-padded as the trainer pads them."""
    batch = build_tokenizer(vocab_size)(PROMPTS, return_tensors="pt", padding=True)
    mask = batch.attention_mask
    with torch.no_grad():
        out: Tensor = model(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids(mask)
        ).logits
    return out * mask.unsqueeze(-1)  # padding's logits are not the policy's


def test_the_export_gives_the_trained_actors_logits_and_the_step_before_does_not(
    trained: JobConfig, tmp_path: Path
) -> None:
    root = Path(trained.trainer.checkpoint.path or "")
    before, last = checkpoint.committed(root)
    assert (checkpoint.step_of(before), checkpoint.step_of(last)) == (STEPS - 1, STEPS)
    assert trained.models.actor.tiny is not None
    vocab = trained.models.actor.tiny.vocab_size
    actor = logits(actor_at(trained, last, tmp_path), vocab)

    exported = export_checkpoint(last, tmp_path / "hf", dtype="fp32").directory
    served = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(served, vocab), actor, rtol=1e-5, atol=1e-5)

    earlier = export_checkpoint(before, tmp_path / "hf-earlier", dtype="fp32").directory
    stale = AutoModelForCausalLM.from_pretrained(earlier, dtype=torch.float32).eval()
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(logits(stale, vocab), actor, rtol=1e-5, atol=1e-5)


def test_the_bf16_export_is_bf16_throughout_and_loads(trained: JobConfig, tmp_path: Path) -> None:
    last = checkpoint.latest(Path(trained.trainer.checkpoint.path or ""))
    assert last is not None
    directory = export_checkpoint(last, tmp_path / "hf").directory
    with safe_open(directory / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_tensor(name).dtype for name in weights.keys()}  # noqa: SIM118
    assert dtypes == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.dtype == torch.bfloat16
    assert trained.models.actor.tiny is not None
    assert torch.isfinite(logits(model, trained.models.actor.tiny.vocab_size)).all()
