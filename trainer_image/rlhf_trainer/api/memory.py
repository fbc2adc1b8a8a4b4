"""The memory each role takes of a GPU, pool by pool (docs/concepts/memory.md); the
admission rule and the table `rlhfjob plan` prints are api.memory_report's.

Pure, like the plan it reads: a JobConfig in, a PoolMemory per pool out. Figures are for
the shapes the trainer uses (roles/): N is the role's ranks (its pool's GPUs), P a
model's parameters, c the bytes of trainer.precision's compute dtype (fp32 4, bf16 2):

    actor, critic   FSDP2 shards over N:  weights 4P/N (fp32 masters; LoRA: the frozen base
                    too), gradients 4T/N and AdamW's two states 8T/N for the T parameters
                    that train; while it steps, 4T/N more (foreach AdamW's sqrt temporaries)
    ref             FSDP2 shards over N as well, in c: cP/N (over the actor's ranks when it
                    shares their pool, none when it is a LoRA actor's own base)
    reward model    likewise, in fp32: 4P/N
    rollout         vLLM takes gpuMemoryUtilization of each GPU: its weights cP/TP, and the
                    rest for the KV cache (2 x layers x kvSize x c bytes a token, / TP)
    runtime         1 GiB a process on a GPU (CUDA context, cuBLAS, NCCL); vLLM's is in
                    its share

Activations, at the micro-batch's shape (rows x prompt+response tokens), as measured on
the tiny model (tests/unit/test_memory.py): each decoder layer keeps 8h + c(6h + 2kv + 4i)
bytes a token for the backward (h hidden, kv kvSize, i the MLP's width; its RMSNorms
keep their input in fp32); the LM head's logits peak at (c + 12, + 4 below fp32) bytes a
token x vocabulary (log-softmax and entropy in fp32); the head's whole gradient, c x its
parameters; with N > 1, FSDP2's gathered copies: the root and two layers, in c. With
gradient checkpointing a layer keeps only its input (ch a token), and one layer at a time
is recomputed.

A GPU's need is what stays (weights, gradients, optimizer, KV cache, runtime, of every
role on it) plus the largest of what comes and goes: one role's activations or optimizer
step (the roles of a pool take turns), or a weight sync's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlhf_trainer.api.config import Device, JobConfig, Role
from rlhf_trainer.api.plan import PlacementPlan, plan_placement, ref_answered_by_actor
from rlhf_trainer.api.shape import ModelShape
from rlhf_trainer.api.transfer import Backend, choose_transfer

GIB = 2**30
FP32_BYTES = 4
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}  # trainer.precision's compute dtype
ADAM_STATE_BYTES = 2 * FP32_BYTES  # exp_avg and exp_avg_sq, fp32, per trained parameter
RUNTIME_BYTES = GIB  # a process's CUDA context, cuBLAS workspace and NCCL buffers
# vLLM's packed NCCL transfer: two 1 GiB buffers on the sender (actor rank 0) and on every
# engine worker (its receive buffers, counted in gpuMemoryUtilization's share:
# rollout.engine_settings.memory_budget): packed_tensor.py.
NCCL_PACKED_BYTES = 2 * GIB
# vLLM's packed IPC transfer: one reusable buffer on each actor rank's GPU, of at least
# the largest tensor (rollout.transfer_engines.IPC_CHUNK_BYTES).
IPC_CHUNK_BYTES = GIB
FSDP_GATHERED_LAYERS = 2  # the layer being computed and the one FSDP2 prefetches


@dataclass(frozen=True)
class RoleMemory:
    """One role's bytes on each GPU of its pool. The first five stay for the whole run;
    the last three come and go (activations and the step while the role trains or
    scores; transfer during a weight sync)."""

    role: Role
    weights_bytes: int
    gradients_bytes: int = 0
    optimizer_bytes: int = 0
    kv_cache_bytes: int = 0
    runtime_bytes: int = 0
    activation_bytes: int = 0
    step_bytes: int = 0
    transfer_bytes: int = 0
    note: str = ""

    @property
    def resident_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.kv_cache_bytes
            + self.runtime_bytes
        )

    @property
    def working_bytes(self) -> int:
        """Its peak beyond what stays, outside a weight sync."""
        return max(self.activation_bytes, self.step_bytes)


@dataclass(frozen=True)
class PoolMemory:
    """The memory per GPU of one pool: each role's, and what is not known."""

    name: str
    index: int  # in spec.pools
    gpu_bytes: int | None  # pools[].gpuMemoryGiB; None: unknown
    roles: tuple[RoleMemory, ...]
    unknown: tuple[str, ...]  # why a figure is missing, one line a role

    @property
    def need_bytes(self) -> int:
        """The peak per GPU of the roles that are known (a lower bound when some are not)."""
        stays = sum(r.resident_bytes for r in self.roles)
        working = max((r.working_bytes for r in self.roles), default=0)
        return stays + max(working, sum(r.transfer_bytes for r in self.roles))

    @property
    def overflows(self) -> bool:
        """Whether the known roles alone need more than the GPU has."""
        return self.gpu_bytes is not None and self.need_bytes > self.gpu_bytes


def model_shape(config: JobConfig, role: Role) -> ModelShape | None:
    """The shape of the model `role` runs (ref and critic default to the actor's)."""
    models = config.models
    source = {Role.REF: models.ref, Role.CRITIC: models.critic}.get(role) or models.actor
    return source.model_shape()


def sequence_tokens(config: JobConfig) -> int:
    """A sample's tokens at most: its prompt and response (a multi-turn episode's budget)."""
    if config.multi_turn is not None:
        return config.multi_turn.max_tokens
    return config.data.max_prompt_length + config.data.max_response_length


def layer_activation_bytes(shape: ModelShape, compute: int) -> int:
    """What one decoder layer keeps a token for the backward (see the module's notes)."""
    h, kv, i = shape.hidden_size, shape.kv_size, shape.intermediate_size
    return 8 * h + compute * (6 * h + 2 * kv + 4 * i)


def logits_bytes(shape: ModelShape, compute: int, backward: bool) -> int:
    """The LM head's peak a token: the logits in c, then in fp32 log-softmax and the
    entropy's softmax and product (roles/policy.policy_outputs); scoring keeps fewer."""
    upcast = FP32_BYTES if compute != FP32_BYTES else 0  # logits.float() copies below fp32
    per_vocab = compute + 3 * FP32_BYTES + upcast if backward else 2 * compute + FP32_BYTES + upcast
    return shape.vocab_size * per_vocab


def training_activation_bytes(
    config: JobConfig, shape: ModelShape, ranks: int, lm_head: bool, head_trains: bool
) -> int:
    """A trained role's peak over a forward/backward of one micro-batch."""
    trainer = config.trainer
    compute = COMPUTE_BYTES[trainer.precision]
    rows = trainer.micro_batch_size or trainer.mini_batch_size // ranks
    tokens = rows * sequence_tokens(config)
    h = shape.hidden_size
    per_layer = layer_activation_bytes(shape, compute)
    if trainer.gradient_checkpointing:
        layers = shape.layers * compute * h + per_layer  # inputs kept, one layer recomputed
    else:
        layers = shape.layers * per_layer
    final_norm = FP32_BYTES * h + 2 * compute * h
    head = logits_bytes(shape, compute, backward=True) if lm_head else 0
    # The LM head's gradient, whole, beside the activations (tied: the embeddings' too).
    head_gradient = compute * shape.embedding_parameters if lm_head and head_trains else 0
    root = shape.parameters(lm_head) - shape.layers * shape.layer_parameters
    # FSDP2 gathers the root and a layer or two in c; measured: nothing more at N = 1.
    gathered = compute * (root + FSDP_GATHERED_LAYERS * shape.layer_parameters)
    return tokens * (layers + final_norm + head) + head_gradient + (gathered if ranks > 1 else 0)


def scoring_bytes(
    config: JobConfig, shape: ModelShape, compute: int, ranks: int, lm_head: bool
) -> int:
    """A forward without gradients over one micro-batch (log-probs, values, rewards): one
    layer's MLP and attention at a time, and the head's output."""
    trainer = config.trainer
    rows = trainer.micro_batch_size or -(-trained_rows(config) // ranks)
    tokens = rows * sequence_tokens(config)
    layer = compute * (4 * shape.hidden_size + 3 * shape.intermediate_size)
    head = logits_bytes(shape, compute, backward=False) if lm_head else 0
    return tokens * (layer + head)


def trained_rows(config: JobConfig) -> int:
    """The most rows a step trains on: one per sample, and with generation.agent up to
    maxSamplesPerEpisode per episode (its calls that extended nothing: algo.row_samples)."""
    agent = config.generation.agent
    return config.samples_per_step * (agent.max_samples_per_episode if agent else 1)


def _shard(parameters: int, ranks: int) -> int:
    return -(-parameters // ranks)


def trained_role(config: JobConfig, role: Role, shape: ModelShape, ranks: int) -> RoleMemory:
    """The actor (a causal LM) or the critic (a backbone and a value head), with FSDP2
    over `ranks`: all its weights train, or a LoRA adapter on the frozen model (whose
    value head, on the critic, trains whole)."""
    lm_head = role is Role.ACTOR
    model = config.models.actor if lm_head else config.models.critic
    lora = model.lora if model is not None else None
    whole = shape.parameters(lm_head)
    adapter = shape.adapter_parameters(lora) if lora is not None else 0
    trains = whole if lora is None else adapter + (0 if lm_head else shape.hidden_size + 1)
    compute = COMPUTE_BYTES[config.trainer.precision]
    training = training_activation_bytes(config, shape, ranks, lm_head, lora is None)
    return RoleMemory(
        role,
        weights_bytes=FP32_BYTES * _shard(whole + adapter, ranks),
        gradients_bytes=FP32_BYTES * _shard(trains, ranks),
        optimizer_bytes=ADAM_STATE_BYTES * _shard(trains, ranks),
        step_bytes=FP32_BYTES * _shard(trains, ranks),
        activation_bytes=max(training, scoring_bytes(config, shape, compute, ranks, lm_head)),
        note=f"sharded over {ranks} rank(s)" + (", LoRA" if lora is not None else ""),
    )


def frozen_role(
    config: JobConfig, role: Role, shape: ModelShape, ranks: int, note: str
) -> RoleMemory:
    """The ref (a causal LM in the compute dtype) or a reward model (a classifier in
    fp32), scoring without gradients: sharded over `ranks` (roles.trainable.prepare_frozen;
    whole on one)."""
    lm_head = role is Role.REF
    dtype_bytes = COMPUTE_BYTES[config.trainer.precision] if lm_head else FP32_BYTES
    return RoleMemory(
        role,
        weights_bytes=dtype_bytes * _shard(shape.parameters(lm_head), ranks),
        activation_bytes=scoring_bytes(config, shape, dtype_bytes, ranks, lm_head),
        note=note,
    )


def rollout_role(config: JobConfig, shape: ModelShape, gpu_bytes: int | None) -> RoleMemory:
    """A vLLM engine's worker: gpuMemoryUtilization of its GPU, its shard of the weights
    (in the compute dtype, over tensorParallelSize GPUs) and the KV cache in the rest."""
    generation = config.generation
    weights = _engine_weight_bytes(config, shape)
    if gpu_bytes is None:
        note = f"gpuMemoryUtilization {generation.gpu_memory_utilization} of a GPU"
        return RoleMemory(Role.ROLLOUT, weights_bytes=weights, note=note)
    share = int(generation.gpu_memory_utilization * gpu_bytes)
    kv_cache = max(share - weights - nccl_receive_bytes(config), 0)
    kv_tokens = kv_cache // kv_bytes_per_token(config, shape)
    note = f"gpuMemoryUtilization {generation.gpu_memory_utilization}: {kv_tokens:,} tokens"
    if nccl_receive_bytes(config):
        note += f", NCCL buffers {nccl_receive_bytes(config) / GIB:g} GiB in the share"
    return RoleMemory(Role.ROLLOUT, weights_bytes=weights, kv_cache_bytes=kv_cache, note=note)


def _engine_weight_bytes(config: JobConfig, shape: ModelShape) -> int:
    compute = COMPUTE_BYTES[config.trainer.precision]  # the engines serve the compute dtype
    return compute * _shard(shape.parameters(lm_head=True), config.generation.tensor_parallel_size)


def kv_bytes_per_token(config: JobConfig, shape: ModelShape) -> int:
    """One token's keys and values in every layer, on one of an engine's GPUs."""
    compute = COMPUTE_BYTES[config.trainer.precision]
    return _shard(
        2 * shape.layers * shape.kv_size * compute, config.generation.tensor_parallel_size
    )


def transfer_bytes(config: JobConfig, shape: ModelShape) -> int:
    """A weight sync's buffers on an actor rank's GPU: a LoRA adapter is gathered whole
    and sent in Ray calls; vLLM's IPC and NCCL run packed, a gathered tensor at a time
    into their buffers; CPU pools use host memory. (An engine's NCCL receive buffers are
    counted in its share of the GPU: `nccl_receive_bytes`.)"""
    compute = COMPUTE_BYTES[config.trainer.precision]
    lora = config.models.actor.lora
    if lora is not None:
        return compute * shape.adapter_parameters(lora)
    backend = choose_transfer(config, cuda=True).backend
    largest = compute * shape.embedding_parameters
    if backend is Backend.IPC:
        return largest + max(IPC_CHUNK_BYTES, largest)
    return largest + NCCL_PACKED_BYTES if backend is Backend.NCCL else 0


def nccl_receive_bytes(config: JobConfig) -> int:
    """An engine worker's NCCL receive buffers, inside its share of the GPU (LoRA: none,
    the adapter travels in Ray calls)."""
    nccl = choose_transfer(config, cuda=True).backend is Backend.NCCL
    return NCCL_PACKED_BYTES if nccl and config.models.actor.lora is None else 0


def memory_plan(config: JobConfig) -> list[PoolMemory]:
    """The memory per GPU of every pool, with each role on it."""
    plan = plan_placement(config)
    found = []
    for index, pool in enumerate(config.pools):
        gpu = round(pool.gpu_memory_gib * GIB) if pool.gpu_memory_gib is not None else None
        roles: list[RoleMemory] = []
        unknown: list[str] = []
        for role, note in _tenants(config, plan, pool.name):
            estimate = _role_memory(config, plan, role, note, gpu)
            if isinstance(estimate, str):
                unknown.append(estimate)
                continue
            if pool.device is Device.GPU and note != IN_ACTOR and role is not Role.ROLLOUT:
                estimate = replace(estimate, runtime_bytes=RUNTIME_BYTES)
            roles.append(estimate)
        if gpu is None and any(r.role is Role.ROLLOUT for r in roles):
            unknown.append(f"rollout: its KV cache, as pools[{index}].gpuMemoryGiB is unset")
        found.append(PoolMemory(pool.name, index, gpu, tuple(roles), tuple(unknown)))
    return found


IN_ACTOR = "in the actor's processes"


def _tenants(config: JobConfig, plan: PlacementPlan, pool: str) -> list[tuple[Role, str]]:
    """The roles whose models live on the pool's GPUs, each with where it runs."""
    beside = {r for r, p in plan.roles.items() if p.pool == pool and r is not Role.ACTOR}
    actor_here = plan.roles[Role.ACTOR].pool == pool
    tenants = [(Role.ACTOR, "")] if actor_here else []
    if actor_here and ref_answered_by_actor(config) and not config.models.ref_is_actor_base:
        tenants.append((Role.REF, IN_ACTOR))
    for role in sorted(beside, key=list(Role).index):
        in_actor = actor_here and role in (Role.CRITIC, Role.REWARD)
        tenants.append((role, IN_ACTOR if in_actor else ""))
    return tenants


def _role_memory(
    config: JobConfig, plan: PlacementPlan, role: Role, note: str, gpu_bytes: int | None
) -> RoleMemory | str:
    """A role's memory on its pool, or why it is unknown."""
    if role is Role.REWARD:
        return "reward: the spec gives no shape for models.reward's model"
    shape = model_shape(config, role)
    if shape is None:
        source = {Role.REF: "ref", Role.CRITIC: "critic"}.get(role, "actor")
        field = f"models.{source}" if getattr(config.models, source) else "models.actor"
        return f"{role}: {field} has a path and no shape"
    ranks = plan.roles[Role.ACTOR if note == IN_ACTOR else role].gpus
    if role in (Role.ACTOR, Role.CRITIC):
        memory = trained_role(config, role, shape, ranks)
        transfer = transfer_bytes(config, shape) if role is Role.ACTOR else 0
        return replace(memory, transfer_bytes=transfer, note=_joined(note, memory.note))
    if role is Role.REF:
        return frozen_role(config, role, shape, ranks, note or f"sharded over {ranks} rank(s)")
    return rollout_role(config, shape, gpu_bytes)


def _joined(*notes: str) -> str:
    return ", ".join(n for n in notes if n)
