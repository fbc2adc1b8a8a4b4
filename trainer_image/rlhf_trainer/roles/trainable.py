"""What every role worker that runs a model shares: loading, micro-batching, and the
PPO update loop of the trainable roles (epochs, mini-batches, gradient accumulation)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from peft import PeftModel
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

from rlhf_trainer.algo.experience import Experience, Sequences, micro_batch_rows, minibatches
from rlhf_trainer.algo.ppo import aggregation_normalizer
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import ModelSource
from rlhf_trainer.models import COMPUTE_DTYPE, ValueModel, build_tiny_model
from rlhf_trainer.roles.checkpoint import load_role_state, save_role_state
from rlhf_trainer.roles.sharding import clip_gradients, load_from_rank0, shard_model
from rlhf_trainer.worker import RankInfo, Worker, derive_seed

Stats = dict[str, float]


def load_policy(
    source: ModelSource, seed: int, dtype: torch.dtype = torch.float32, weights: bool = True
) -> PreTrainedModel:
    """The causal LM in `dtype`, built in memory when tiny (saving it to load it back
    would not do: transformers writes only on rank 0 once torch.distributed is up).
    weights=False: the architecture only, its initial weights (for the meta device)."""
    if source.tiny is not None:
        return build_tiny_model(source.tiny, seed).to(dtype)
    if not weights:
        architecture = AutoConfig.from_pretrained(source.path)
        empty: PreTrainedModel = AutoModelForCausalLM.from_config(architecture, dtype=dtype)
        return empty
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    return model


def load_value_model(source: ModelSource, seed: int, weights: bool = True) -> ValueModel:
    """The critic: the source's transformer backbone with a fresh value head."""
    if source.tiny is not None:
        return ValueModel(build_tiny_model(source.tiny, seed).model)
    assert source.path is not None
    if not weights:
        architecture = AutoConfig.from_pretrained(source.path)
        return ValueModel(AutoModel.from_config(architecture, dtype=torch.float32))
    return ValueModel.from_pretrained(source.path)


def prepare_trainable(
    load: Callable[[bool], nn.Module], config: JobConfig, device: torch.device
) -> nn.Module:
    """A trained role's model as it trains: sharded with FSDP2 in the spec's precision
    (`sharded_from_rank0`), on its device, with activation checkpointing if the spec
    asks for it."""

    def checkpointing(model: nn.Module) -> None:
        transformer = model.backbone if isinstance(model, ValueModel) else model
        if isinstance(transformer, PeftModel):  # LoRA: the transformer under the adapter
            transformer = transformer.get_base_model()
        assert isinstance(transformer, PreTrainedModel), type(transformer)
        # Non-reentrant: the variant that works under FSDP2 and with frozen inputs.
        transformer.gradient_checkpointing_enable({"use_reentrant": False})

    compute_dtype = COMPUTE_DTYPE[config.trainer.precision]
    before = checkpointing if config.trainer.gradient_checkpointing else None
    return sharded_from_rank0(load, compute_dtype, device, before)


def prepare_frozen(
    load: Callable[[bool], nn.Module], compute_dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """A model that never trains (the ref, a reward model), on its device, in eval
    mode. Over several ranks it is sharded as the actor is (`sharded_from_rank0`): each
    GPU holds its shard and one layer gathered at a time, not a whole copy (a 70B ref in
    bf16 is 140 GB). Its ranks then run each forward together, as they run the actor's
    (equal shards of a batch: the spec's rules). On one rank: whole, unsharded."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return load(True).to(device).eval()
    return sharded_from_rank0(load, compute_dtype, device).eval()


def sharded_from_rank0(
    load: Callable[[bool], nn.Module],
    compute_dtype: torch.dtype,
    device: torch.device,
    before_sharding: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """`load(weights)`'s model (with its weights, or as architecture only) sharded with
    FSDP2 over the default process group, computing in `compute_dtype`. Only rank 0
    holds a whole copy (on the CPU, while it loads): every rank builds the model on the
    meta device (no memory), shards it, allocates its own shard on its device, and rank
    0 broadcasts the weights into the shards (`load_from_rank0`). A node of 8 ranks
    thus reads a 7B checkpoint once, not 8 times into 8 copies. A collective."""
    loaded = load(True) if dist.get_rank() == 0 else None
    with torch.device("meta"):
        model = load(False)
    if before_sharding is not None:
        before_sharding(model)
    model = shard_model(model, compute_dtype)
    model.to_empty(device=device)
    load_from_rank0(model, loaded)
    return model


BatchT = TypeVar("BatchT", bound=Sequences)


def micro_batches(
    batch: BatchT, size: int | None, device: torch.device
) -> Iterator[tuple[Tensor, slice, BatchT]]:
    """`batch` in micro-batches of `size` rows (all of it when None), rows of similar
    length together and each cut to its own width, on `device`: (rows, columns,
    micro-batch)."""
    for rows in micro_batch_rows(batch, size):
        micro, columns = cut(batch, rows, device)
        yield rows, columns, micro


def cut(batch: BatchT, rows: Tensor, device: torch.device) -> tuple[BatchT, slice]:
    """The micro-batch of `rows`, trimmed to its own width (`Sequences.trimmed`), on
    `device`; and the columns it kept. A batch already there is not rebuilt."""
    micro, columns = batch.select(rows).trimmed()
    return (micro if micro.input_ids.device == device else micro.to(device)), columns


def update_plan(batch: Sequences, minis: list[Tensor], size: int | None) -> list[list[Tensor]]:
    """The rows of `batch` in each micro-batch of each mini-batch `minis` (row indices):
    what `micro_batch_rows` cuts of each mini-batch, found once for the update, without
    copying the mini-batches (their rows are cut from `batch` itself)."""
    lengths = batch.attention_mask.sum(dim=1)
    plan = []
    for indices in minis:
        order = torch.argsort(lengths[indices], descending=True, stable=True)
        plan.append(list(torch.split(indices[order], size or max(len(indices), 1))))
    return plan


def per_token(
    batch: Sequences,
    size: int | None,
    outputs: Callable[[Sequences], Tensor],
    device: torch.device,
) -> Tensor:
    """(B, T) `outputs` of each micro-batch computed on `device`, put back in the
    batch's layout (and on its device), on the response tokens only (0 elsewhere)."""
    result = torch.zeros_like(batch.response_mask)
    for rows, columns, micro in micro_batches(batch, size, device):
        result[rows, columns] = outputs(micro).to(result.device)
    return result * batch.response_mask


def scalar(value: Tensor) -> float:
    return float(value.detach())


def all_ranks_sum(value: Tensor) -> Tensor:
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total


class Trainable(Worker):
    """What the actor and the critic share: PPO epochs over mini-batches, gradient
    accumulation over micro-batches, clipping, and checkpoints of model + optimizer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, info: RankInfo, config: JobConfig) -> None:
        super().__init__(info)
        self.config = config

    def loss(self, micro: Experience, normalizer: Tensor) -> tuple[Tensor, Stats]:
        raise NotImplementedError

    def update(self, batch: Experience, step: int) -> Stats:
        """PPO epochs over this rank's shard; returns the mean of each statistic."""
        trainer = self.config.trainer
        world = self.info.world_size
        # The same order on a resumed run: it depends on the step, not on history.
        generator = torch.Generator().manual_seed(
            derive_seed(trainer.seed, "minibatches", step, self.info.rank)
        )
        minis = [
            indices
            for _ in range(trainer.epochs)
            for indices in minibatches(len(batch), trainer.mini_batch_size // world, generator)
        ]
        normalizers = self.normalizers(batch, minis)
        micro_stats: list[Stats] = []
        grad_norms: list[float] = []
        self.model.train()
        plan = update_plan(batch, minis, trainer.micro_batch_size)
        for micro_rows, normalizer in zip(plan, normalizers, strict=True):
            self.optimizer.zero_grad(set_to_none=True)
            for rows in micro_rows:
                loss, stats = self.loss(cut(batch, rows, self.info.device)[0], normalizer)
                # FSDP averages gradients over the ranks; the normalizer already
                # divides by the global count, so undo the average.
                (loss * world).backward()  # type: ignore[no-untyped-call]
                micro_stats.append(stats)
            grad_norms.append(clip_gradients(self.model, trainer.max_grad_norm))
            # Nothing counted on any rank (every sample unscored): no step, or AdamW's
            # momentum and weight decay would move the weights on no data.
            if normalizer > 0:
                self.optimizer.step()
        self.model.eval()
        means = {
            name: sum(s[name] for s in micro_stats) / len(micro_stats) for name in micro_stats[0]
        }
        return {**means, "grad_norm": sum(grad_norms) / len(grad_norms)}

    def normalizers(self, batch: Experience, minis: list[Tensor]) -> Tensor:
        """Each mini-batch's token (or sequence) count over all ranks, so micro-batch
        losses add up to the mini-batch loss: (len(minis),), on this rank's device. One
        all-reduce for the update's mini-batches, not one each (every rank draws as many:
        FSDP's collectives already need that)."""
        mode = self.config.algorithm.loss_aggregation
        counts = [aggregation_normalizer(batch.response_mask[i], mode) for i in minis]
        return all_ranks_sum(torch.stack(counts).to(self.info.device))

    def save(self, directory: str) -> None:
        save_role_state(Path(directory), self.model, self.optimizer)

    def load(self, directory: str) -> None:
        load_role_state(Path(directory), self.model, self.optimizer)
