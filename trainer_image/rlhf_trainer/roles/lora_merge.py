"""A LoRA'd actor's adapter merged into its base, for an export of the whole model.

The merge (W + BA) runs in fp32: the base is built in fp32 (`load_policy`'s default)
and the adapter is the checkpoint's fp32 master. What the export's dtype then keeps of
the update is the question. Early in a run |BA| is ~1e-3 of |W|, below bf16's rounding
step (2^-8 of |W|): rounded to bf16, W + BA lands back on W or past it, and the update
is mostly lost (measured: 163% of it at 1e-3, 23% at 1e-2). So a merged export is fp32
unless asked otherwise; one asked in bf16 says how much of the update it lost.

The merge streams (`write_merged`): the base's weights are read one tensor at a time
(from the model directory's safetensors files, or a tiny model's state), each adapted
one gets its W + BA in fp32, and each is cast to the export's dtype into safetensors
shards of at most SHARD_BYTES. So the memory is one shard in the export's dtype, plus
an adapted weight, its update and their sum in fp32: not the model. The adapter's
update comes from the adapter alone, on a base built on the meta device.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.lora.layer import Linear as LoraLinear
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from transformers import PreTrainedModel

from rlhf_trainer.api.sections import TrainedModel
from rlhf_trainer.models import build_tiny_model

log = logging.getLogger(__name__)

UPDATE_LOST_BOUND = 0.01  # past this fraction of the update lost, the export says so
ADAPTER = "default"  # peft's name for the one adapter the actor trains
SHARD_BYTES = 2 << 30  # an export's safetensors file holds at most this much
WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def update_lost(model: PeftModel, dtype: torch.dtype) -> float:
    """The part of the adapter's update that writing the merged weights in `dtype`
    loses: ‖(round(W + ΔW) - round(W)) - ΔW‖ / ‖ΔW‖ over every adapted weight, with W
    the base (fp32) and round() the cast to `dtype` (0 for an adapter that changes
    nothing). Above 1 the rounding error is larger than the update itself."""
    error, update = 0.0, 0.0
    with torch.no_grad():
        for module in adapted_modules(model).values():
            weight = module.get_base_layer().weight
            assert isinstance(weight, torch.Tensor), type(weight)
            base = weight.float()
            delta = module.get_delta_weight(ADAPTER).float()
            terms = lost_terms(base, delta, dtype)
            error, update = error + terms[0], update + terms[1]
    return (error / update) ** 0.5 if update > 0 else 0.0


def lost_terms(base: Tensor, delta: Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """‖(round(W + ΔW) - round(W)) - ΔW‖² and ‖ΔW‖² of one weight (`update_lost`)."""
    served = (base + delta).to(dtype).float() - base.to(dtype).float()
    return float((served - delta).square().sum()), float(delta.square().sum())


def adapted_modules(model: PeftModel) -> dict[str, LoraLinear]:
    """The adapted layers, by their base weight's name in the merged model."""
    return {
        name.removeprefix("base_model.model.") + ".weight": module
        for name, module in model.named_modules()
        if isinstance(module, LoraLinear) and ADAPTER in module.lora_A
    }


def warn_if_lost(lost: float, dtype: torch.dtype, asked: str) -> None:
    if lost > UPDATE_LOST_BOUND:
        log.warning(
            "%s loses %.0f%% of the LoRA update in the merged weights (W + BA rounded to "
            "%s); fp32 keeps it, or write the adapter alone (output.lora: adapter, "
            "--adapter)",
            asked, 100 * lost, str(dtype).removeprefix("torch."),
        )  # fmt: skip


def merged_policy(model: PeftModel, dtype: torch.dtype, asked: str) -> PreTrainedModel:
    """The base with the adapter merged into its weights in fp32, cast to `dtype`. When
    the cast loses more than 1% of the update (`update_lost`), a warning says how much,
    naming `asked` (the field or flag and its value, e.g. "output.dtype bf16")."""
    model = model.float()  # the merge's sum in fp32, whatever the base was built in
    warn_if_lost(update_lost(model, dtype), dtype, asked)
    merged: PreTrainedModel = model.merge_and_unload()
    return merged.to(dtype)


# The merge, streamed.

BaseWeights = Iterator[tuple[str, Tensor]]


def base_weights(actor: TrainedModel, seed: int, names: set[str]) -> BaseWeights | None:
    """The base's weights one at a time, by the merged model's names: a tiny model's
    built from `seed`, else read from the safetensors weights of models.actor.path (as
    transformers finds them: model.safetensors or the files its index names), when it
    is a local directory and they hold every adapted weight (`names`). None otherwise
    (a hub id, .bin weights, names that transformers converts on loading): the merge
    then loads the whole base (`merged_policy`)."""
    if actor.tiny is not None:
        return tiny_weights(build_tiny_model(actor.tiny, seed))
    assert actor.path is not None
    files = weight_files(Path(actor.path))
    held: set[str] = set()
    for file in files:
        with safe_open(file, "pt") as weights:
            held |= set(weights.keys())
    return file_weights(files) if files and names <= held else None


def weight_files(directory: Path) -> list[Path]:
    """A model directory's safetensors weights as transformers reads them (not every
    *.safetensors: some repositories hold a second copy under other names)."""
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    return [directory / WEIGHTS_FILE] if (directory / WEIGHTS_FILE).is_file() else []


def tiny_weights(model: PreTrainedModel) -> BaseWeights:
    """A model's weights, a tied one once (as save_pretrained writes them)."""
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            yield name, tensor


def file_weights(files: list[Path]) -> BaseWeights:
    for file in files:
        with safe_open(file, "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, weights.get_tensor(name)


def write_merged(
    model: PeftModel, base: BaseWeights, dtype: torch.dtype, directory: Path, asked: str
) -> None:
    """The base's weights (`base`, streamed) with `model`'s adapter merged in fp32,
    cast to `dtype`, into `directory`'s safetensors files (with an index where there
    are several). A warning names `asked` when the cast loses the update (`update_lost`)."""
    adapted = adapted_modules(model)
    shards: list[dict[str, Tensor]] = [{}]
    sizes, error, update = [0], 0.0, 0.0
    with torch.no_grad():
        for name, tensor in base:
            if name in adapted:
                weight, delta = tensor.float(), adapted.pop(name).get_delta_weight(ADAPTER).float()
                terms = lost_terms(weight, delta, dtype)
                error, update = error + terms[0], update + terms[1]
                tensor = weight + delta
            written = tensor.to(dtype).contiguous()
            if sizes[-1] and sizes[-1] + written.nbytes > SHARD_BYTES:
                save_shard(shards, directory)
                shards.append({})
                sizes.append(0)
            shards[-1][name] = written
            sizes[-1] += written.nbytes
    assert not adapted, f"adapted weights missing from the base: {sorted(adapted)[:3]}"
    save_shard(shards, directory)
    write_index(shards, sum(sizes), directory)
    warn_if_lost((error / update) ** 0.5 if update > 0 else 0.0, dtype, asked)


def shard_name(index: int, count: int) -> str:
    return WEIGHTS_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def save_shard(shards: list[dict[str, Tensor]], directory: Path) -> None:
    """Write the last shard under a provisional name and free its tensors (the names
    stay, for the index)."""
    index = len(shards)
    save_file(shards[-1], directory / f".shard-{index:05d}", metadata={"format": "pt"})
    shards[-1] = dict.fromkeys(shards[-1], torch.empty(0))


def write_index(shards: list[dict[str, Tensor]], total: int, directory: Path) -> None:
    """The shards under their final names and, for several, the index transformers and
    vLLM read (model.safetensors.index.json)."""
    count = len(shards)
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        os.rename(directory / f".shard-{index:05d}", directory / shard_name(index, count))
        weight_map |= dict.fromkeys(shard, shard_name(index, count))
    if count > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n")
