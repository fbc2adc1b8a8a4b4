"""A LoRA'd actor's adapter merged into its base, for an export of the whole model.

The merge (W + BA) runs in fp32: the base is built in fp32 (`load_policy`'s default)
and the adapter is the checkpoint's fp32 master. What the export's dtype then keeps of
the update is the question. Early in a run |BA| is ~1e-3 of |W|, below bf16's rounding
step (2^-8 of |W|): rounded to bf16, W + BA lands back on W or past it, and the update
is mostly lost (measured: 163% of it at 1e-3, 23% at 1e-2). So a merged export is fp32
unless asked otherwise; one asked in bf16 says how much of the update it lost.
"""

from __future__ import annotations

import logging

import torch
from peft import PeftModel
from peft.tuners.lora.layer import Linear as LoraLinear
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

UPDATE_LOST_BOUND = 0.01  # past this fraction of the update lost, the export says so
ADAPTER = "default"  # peft's name for the one adapter the actor trains


def update_lost(model: PeftModel, dtype: torch.dtype) -> float:
    """The part of the adapter's update that writing the merged weights in `dtype`
    loses: ‖(round(W + ΔW) - round(W)) - ΔW‖ / ‖ΔW‖ over every adapted weight, with W
    the base (fp32) and round() the cast to `dtype` (0 for an adapter that changes
    nothing). Above 1 the rounding error is larger than the update itself."""
    error, update = 0.0, 0.0
    with torch.no_grad():
        for module in model.modules():
            if not (isinstance(module, LoraLinear) and ADAPTER in module.lora_A):
                continue
            weight = module.get_base_layer().weight
            assert isinstance(weight, torch.Tensor), type(weight)
            base = weight.float()
            delta = module.get_delta_weight(ADAPTER).float()
            served = (base + delta).to(dtype).float() - base.to(dtype).float()
            error += float((served - delta).square().sum())
            update += float(delta.square().sum())
    return (error / update) ** 0.5 if update > 0 else 0.0


def merged_policy(model: PeftModel, dtype: torch.dtype, asked: str) -> PreTrainedModel:
    """The base with the adapter merged into its weights in fp32, cast to `dtype`. When
    the cast loses more than 1% of the update (`update_lost`), a warning says how much,
    naming `asked` (the field or flag and its value, e.g. "output.dtype bf16")."""
    model = model.float()  # the merge's sum in fp32, whatever the base was built in
    lost = update_lost(model, dtype)
    if lost > UPDATE_LOST_BOUND:
        log.warning(
            "%s loses %.0f%% of the LoRA update in the merged weights (W + BA rounded to "
            "%s); fp32 keeps it, or write the adapter alone (output.lora: adapter, "
            "--adapter)",
            asked, 100 * lost, str(dtype).removeprefix("torch."),
        )  # fmt: skip
    merged: PreTrainedModel = model.merge_and_unload()
    return merged.to(dtype)
