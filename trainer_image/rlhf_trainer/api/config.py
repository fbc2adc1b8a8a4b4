"""The trainer-facing part of an RLHFJob spec.

This is the data contract between the operator and the trainer image: the operator
validates the whole RLHFJob, then hands `JobConfig` to the trainer as JSON. It must
stay importable without torch or Ray (the operator imports it).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, StringConstraints
from pydantic.config import JsonDict

from rlhf_trainer.api.rules import Rule, SpecModel

# Pool names become KubeRay worker-group names, Ray resource names and label values.
PoolName = Annotated[
    str,
    StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", min_length=1, max_length=30),
    Field(description="A pool name: lowercase letters, digits and '-', at most 30 characters."),
]


class Role(StrEnum):
    """The five roles of PPO-style RLHF."""

    ACTOR = "actor"  # the policy being trained
    ROLLOUT = "rollout"  # generation with the policy (vLLM)
    REF = "ref"  # frozen reference policy, for the KL term
    CRITIC = "critic"  # value model
    REWARD = "reward"  # reward model (a rule-based reward function needs no pool)


class PoolConfig(SpecModel):
    """A named group of GPU nodes. Roles mapped to the same pool take turns on its GPUs."""

    name: PoolName
    replicas: int = Field(1, ge=1, le=512, description="Nodes in this pool.")
    gpus_per_node: int = Field(
        8, ge=1, le=16, description="GPUs used on each node of this pool (at least 1)."
    )

    @property
    def total_gpus(self) -> int:
        return self.replicas * self.gpus_per_node


class RoleMapping(SpecModel):
    """Which pool each role runs on. Roles on different pools run at the same time."""

    actor: PoolName = Field(description="Pool of the actor (the policy being trained).")
    rollout: PoolName = Field(
        description="Pool of the rollout engines (vLLM). Give it its own pool for fully async."
    )
    critic: PoolName = Field(description="Pool of the critic (value model).")
    ref: PoolName | None = Field(
        None,
        description="Pool of the frozen reference policy. Required when algorithm.klCoef > 0.",
    )
    reward: PoolName | None = Field(
        None,
        description=(
            "Pool of the reward model. Required when models.reward is a model path; "
            "a rule-based reward function runs on CPU and needs no pool."
        ),
    )

    def pools_in_use(self) -> dict[Role, str]:
        """Role -> pool, for the roles that are mapped."""
        return {Role(role): pool for role, pool in self.model_dump().items() if pool is not None}


class AsyncConfig(SpecModel):
    """Fully asynchronous training: a rollout pool streams samples to the trainer pools."""

    staleness_threshold: float = Field(
        0.5,
        ge=0,
        le=16,
        description=(
            "How far generation may run ahead of training. With B samples a step and a "
            "weight sync every K steps, the rollouter stops admitting prompts once "
            "B*K*(1+s) were admitted since the last sync. 0 = synchronous, on-policy."
        ),
    )
    trigger_parameter_sync_step: int = Field(
        1, ge=1, le=1024, description="Trainer steps between weight syncs to the rollout pool."
    )
    partial_rollout: bool = Field(
        True,
        description=(
            "At a weight sync, pause in-flight generations and resume them on the new "
            "weights (keeping tokens already made) instead of waiting for them."
        ),
    )


TINY_MIN_HEAD_DIM = 32  # vLLM's CPU attention kernels need head_dim >= 32


class TinyModel(SpecModel):
    """A small causal LM built from this config at run time (tests, demos); no download."""

    architecture: Literal["qwen2", "llama"] = Field("qwen2", description="Model family.")
    hidden_size: int = Field(128, ge=32, le=8192, description="Hidden size.")
    num_layers: int = Field(2, ge=1, le=64, description="Transformer layers.")
    num_heads: int = Field(4, ge=1, le=128, description="Attention heads.")
    vocab_size: int = Field(
        512, ge=16, le=262144, description="Vocabulary size (the built-in tokenizer's)."
    )

    rules = (
        Rule(
            "hiddenSize",
            f"hiddenSize / numHeads (the head dim) must be a whole number >= {TINY_MIN_HEAD_DIM}",
            f"self.hiddenSize % self.numHeads == 0 && "
            f"self.hiddenSize / self.numHeads >= {TINY_MIN_HEAD_DIM}",
            lambda m: (
                m.hidden_size % m.num_heads == 0
                and m.hidden_size // m.num_heads >= TINY_MIN_HEAD_DIM
            ),
        ),
    )


class ModelSource(SpecModel):
    """Where a model comes from: a checkpoint path, or a tiny model built from a config."""

    path: str | None = Field(
        None,
        min_length=1,
        description="A Hugging Face-format checkpoint: a local directory or a hub model id.",
    )
    tiny: TinyModel | None = Field(None, description="Build a tiny model from this config.")

    rules = (
        Rule(
            "",
            "set exactly one of path or tiny",
            "has(self.path) != has(self.tiny)",
            lambda m: (m.path is None) != (m.tiny is None),
        ),
    )


REWARD_FUNCTION_PATTERN = r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$"


class RewardSource(SpecModel):
    """The reward: a reward model, or a rule-based function of the prompt and response."""

    path: str | None = Field(
        None, min_length=1, description="A reward model checkpoint (local directory or hub id)."
    )
    function: str | None = Field(
        None,
        pattern=REWARD_FUNCTION_PATTERN,
        description=(
            "A rule-based reward: a built-in name (e.g. 'toy_copy') or 'module:function' "
            "importable in the trainer image."
        ),
    )

    rules = (
        Rule(
            "",
            "set exactly one of path or function",
            "has(self.path) != has(self.function)",
            lambda m: (m.path is None) != (m.function is None),
        ),
    )


class ModelsConfig(SpecModel):
    """The models of the job. ref and critic start from the actor's model unless set."""

    actor: ModelSource = Field(description="The initial policy.")
    ref: ModelSource | None = Field(
        None, description="The reference policy; defaults to the actor's initial model."
    )
    critic: ModelSource | None = Field(
        None, description="The value model's backbone; defaults to the actor's initial model."
    )
    reward: RewardSource = Field(description="The reward model or rule-based reward function.")


class DataConfig(SpecModel):
    """The prompts to train on."""

    train: str = Field(
        min_length=1,
        description=(
            "Training prompts: a JSONL file path (one object per line, the prompt under "
            "promptKey), or 'toy:<task>' for a "
            "built-in generated task (e.g. 'toy:copy')."
        ),
    )
    prompt_key: str = Field("prompt", min_length=1, description="Column holding the prompt.")
    max_prompt_length: int = Field(512, ge=1, le=131072, description="Prompt tokens, at most.")
    max_response_length: int = Field(
        512, ge=1, le=131072, description="Generated tokens per response, at most."
    )
    shuffle: bool = Field(True, description="Shuffle prompts every epoch (seeded).")


class AlgorithmConfig(SpecModel):
    """PPO hyper-parameters."""

    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    clip_ratio: float = Field(0.2, gt=0, le=1, description="PPO policy clip range epsilon.")
    dual_clip: float | None = Field(
        None,
        gt=1,
        le=100,
        description="Dual-clip constant c (> 1) bounding the loss of negative advantages.",
    )
    value_clip: float | None = Field(
        0.2, gt=0, le=100, description="Value-loss clip range; unset disables value clipping."
    )
    kl_coef: float = Field(0.05, ge=0, le=10, description="KL penalty coefficient; 0 = no ref.")
    kl_mode: Literal["reward", "loss"] = Field(
        "reward", description="Apply KL as a per-token reward penalty, or as a loss term."
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k1", description="KL estimator: k1 = log-ratio, k3 = unbiased low-variance."
    )
    entropy_coef: float = Field(0.0, ge=0, le=1, description="Entropy bonus coefficient.")
    whiten_advantages: bool = Field(True, description="Normalise advantages per batch.")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How per-token losses are averaged into one number."
    )
    importance_cap: float = Field(
        2.0,
        ge=1,
        le=100,
        description=(
            "Cap of the truncated importance weight between the trainer's and the "
            "rollout's log-probs (off-policy correction of stale samples)."
        ),
    )


class GenerationConfig(SpecModel):
    """Sampling and engine settings of the rollout role."""

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling probability mass.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=16, description="GPUs per vLLM engine; must divide the pool's gpusPerNode."
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of GPU memory vLLM may take."
    )


class CheckpointConfig(SpecModel):
    """Where and how often to checkpoint; a restarted job resumes from the latest."""

    path: str = Field(
        "/checkpoints", min_length=1, description="Directory for checkpoints (a shared volume)."
    )
    every_steps: int = Field(50, ge=1, description="Checkpoint every this many steps.")
    keep: int = Field(2, ge=1, le=1000, description="How many recent checkpoints to keep.")


class TrainerConfig(SpecModel):
    """The training schedule."""

    total_steps: int = Field(100, ge=1, le=10_000_000, description="PPO steps to run.")
    batch_size: int = Field(
        64, ge=1, le=1_000_000, description="Prompts generated and trained on per PPO step."
    )
    mini_batch_size: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description=(
            "Samples per optimizer step; must divide batchSize and be a multiple of the "
            "actor's and the critic's data-parallel size (their pool's GPUs)."
        ),
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description=(
            "Samples per forward/backward on one GPU (gradient accumulation); "
            "unset = the whole per-GPU mini-batch at once."
        ),
    )
    epochs: int = Field(1, ge=1, le=100, description="PPO epochs over each batch.")
    actor_learning_rate: float = Field(1e-6, gt=0, le=1, description="Actor learning rate.")
    critic_learning_rate: float = Field(1e-5, gt=0, le=1, description="Critic learning rate.")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="Gradient clipping norm.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for data order and sampling.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )


def _pool_gpus(config: JobConfig, pool: str | None) -> int | None:
    """GPUs of the named pool, or None when it is not declared."""
    return next((p.total_gpus for p in config.pools if p.name == pool), None)


def _pool_has_role(config: JobConfig, pool: str) -> bool:
    return pool in config.roles.pools_in_use().values()


def _divides_dp(config: JobConfig, role: Role) -> bool:
    """mini-batch (and micro-batch) split evenly over the role's data-parallel ranks."""
    trainer = config.trainer
    pool = getattr(config.roles, role.value)
    for dp in (p.total_gpus for p in config.pools if p.name == pool):
        if trainer.mini_batch_size % dp:
            return False
        micro = trainer.micro_batch_size
        if micro is not None and (trainer.mini_batch_size // dp) % micro:
            return False
    return True


def _dp_rule(role: Role) -> Rule:
    r = role.value

    def detail(c: JobConfig) -> str:
        pool = getattr(c.roles, r)
        return (
            f"miniBatchSize {c.trainer.mini_batch_size}, microBatchSize "
            f"{c.trainer.micro_batch_size}, pool {pool!r} has {_pool_gpus(c, pool)} GPUs"
        )

    return Rule(
        "trainer.miniBatchSize",
        f"must be a multiple of the {r} pool's GPUs (the {r}'s data-parallel size), "
        f"and miniBatchSize / those GPUs a multiple of microBatchSize",
        f"self.pools.filter(p, p.name == self.roles.{r}).all(p, "
        f"self.trainer.miniBatchSize % (p.replicas * p.gpusPerNode) == 0 && "
        f"(!has(self.trainer.microBatchSize) || "
        f"(self.trainer.miniBatchSize / (p.replicas * p.gpusPerNode)) "
        f"% self.trainer.microBatchSize == 0))",
        lambda c: _divides_dp(c, role),
        detail,
    )


def _declared_pool_rule(role: Role, optional: bool) -> Rule:
    r = role.value
    cel = f"self.pools.exists(p, p.name == self.roles.{r})"
    return Rule(
        f"roles.{r}",
        "must name a pool declared in spec.pools",
        f"!has(self.roles.{r}) || {cel}" if optional else cel,
        lambda c: getattr(c.roles, r) is None or _pool_gpus(c, getattr(c.roles, r)) is not None,
        lambda c: f"got {getattr(c.roles, r)!r}; declared: {', '.join(p.name for p in c.pools)}",
    )


POOLS_DESCRIPTION = "The GPU pools; names must be unique."
# A list keyed by name: the API server rejects duplicates and merges pools by name.
POOLS_LIST_MAP: JsonDict = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["name"],
}

_ROLES_IN_USE_CEL = (
    "[self.roles.actor, self.roles.rollout, self.roles.critic]"
    " + (has(self.roles.ref) ? [self.roles.ref] : [])"
    " + (has(self.roles.reward) ? [self.roles.reward] : [])"
)


class JobConfig(SpecModel):
    """Everything the trainer needs: pools, role placement, models, data, algorithm."""

    pools: list[PoolConfig] = Field(
        min_length=1, max_length=16, description=POOLS_DESCRIPTION, json_schema_extra=POOLS_LIST_MAP
    )
    roles: RoleMapping = Field(description="Which pool each role runs on.")
    async_: AsyncConfig | None = Field(
        None,
        alias="async",
        description=(
            "Set to train fully asynchronously (the rollout role needs a pool of its own); "
            "unset = synchronous PPO."
        ),
    )
    models: ModelsConfig = Field(description="The models.")
    data: DataConfig = Field(description="The training prompts.")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="PPO hyper-parameters."
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Rollout sampling and engine settings."
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The schedule.")

    rules = (
        Rule(
            "pools",
            "pool names must be unique",
            "self.pools.all(p, self.pools.exists_one(q, q.name == p.name))",
            lambda c: len({p.name for p in c.pools}) == len(c.pools),
        ),
        *(_declared_pool_rule(r, optional=False) for r in (Role.ACTOR, Role.ROLLOUT, Role.CRITIC)),
        *(_declared_pool_rule(r, optional=True) for r in (Role.REF, Role.REWARD)),
        Rule(
            "pools",
            "every pool must host at least one role (an unused pool wastes its GPUs)",
            f"self.pools.all(p, p.name in {_ROLES_IN_USE_CEL})",
            lambda c: all(_pool_has_role(c, p.name) for p in c.pools),
            lambda c: (
                "unused: " + ", ".join(p.name for p in c.pools if not _pool_has_role(c, p.name))
            ),
        ),
        Rule(
            "roles.ref",
            "is required when algorithm.klCoef > 0 (the KL term needs the reference policy)",
            "has(self.roles.ref) || self.algorithm.klCoef == 0.0",
            lambda c: c.roles.ref is not None or c.algorithm.kl_coef == 0,
        ),
        Rule(
            "roles.reward",
            "is required when models.reward is a model path (a reward model needs GPUs)",
            "has(self.roles.reward) || !has(self.models.reward.path)",
            lambda c: c.roles.reward is not None or c.models.reward.path is None,
        ),
        Rule(
            "roles.rollout",
            "fully async needs the rollout on a pool of its own, not the actor's pool",
            "!has(self.async) || self.roles.rollout != self.roles.actor",
            lambda c: c.async_ is None or c.roles.rollout != c.roles.actor,
        ),
        Rule(
            "trainer.miniBatchSize",
            "must divide trainer.batchSize",
            "self.trainer.batchSize % self.trainer.miniBatchSize == 0",
            lambda c: c.trainer.batch_size % c.trainer.mini_batch_size == 0,
        ),
        _dp_rule(Role.ACTOR),
        _dp_rule(Role.CRITIC),
        Rule(
            "generation.tensorParallelSize",
            "must divide the rollout pool's gpusPerNode (an engine stays within one node)",
            "self.pools.filter(p, p.name == self.roles.rollout)"
            ".all(p, p.gpusPerNode % self.generation.tensorParallelSize == 0)",
            lambda c: all(
                p.gpus_per_node % c.generation.tensor_parallel_size == 0
                for p in c.pools
                if p.name == c.roles.rollout
            ),
        ),
    )

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)


class TrainingProgress(SpecModel):
    """Progress the trainer reports into the RLHFJob's status."""

    step: int = Field(0, ge=0, description="PPO steps completed.")
    total_steps: int = Field(0, ge=0, description="PPO steps to run.")
    samples_per_second: float | None = Field(None, ge=0, description="Recent throughput.")
    policy_version: int = Field(0, ge=0, description="Version of the policy being trained.")
    reward_mean: float | None = Field(None, description="Mean reward of the last step.")
    last_checkpoint: str | None = Field(None, description="Path of the newest checkpoint.")
