"""Checks on a Hugging Face export against the checkpoint it should hold."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.models import build_tiny_model


def checkpoint_actor(tiny: TinyModel, step_dir: Path, scratch: Path) -> PreTrainedModel:
    """A committed checkpoint's actor weights in the project's own model class, read back
    by torch's DCP converter (not by the export's reader)."""
    model = build_tiny_model(tiny, seed=1234)  # its weights are replaced below
    dcp_to_torch_save(step_dir / "actor", scratch / "actor.pt")
    model.load_state_dict(torch.load(scratch / "actor.pt", weights_only=False)["model"])
    return model.eval()


def assert_export_holds(export: Path, actor: PreTrainedModel, dtype: torch.dtype) -> None:
    """`export` (as transformers loads it, in the dtype it was saved in) holds `actor`'s
    weights cast to `dtype`, bit for bit."""
    served = AutoModelForCausalLM.from_pretrained(export, dtype="auto").state_dict()
    for name, weight in actor.state_dict().items():
        assert served[name].dtype == dtype, name
        assert torch.equal(served[name], weight.to(dtype)), name
