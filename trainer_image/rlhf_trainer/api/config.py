"""The trainer-facing part of an RLHFJob spec.

This is the data contract between the operator and the trainer image: the operator
validates the whole RLHFJob, then hands `JobConfig` to the trainer as JSON. It must
stay importable without torch or Ray (the operator imports it).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints
from pydantic.config import JsonDict

from rlhf_trainer.api.agentic import EnvironmentConfig, MultiTurnConfig, multi_turn_rules
from rlhf_trainer.api.agents import AgentConfig, agent_rules
from rlhf_trainer.api.algorithm import GROUP_ESTIMATORS, AlgorithmConfig
from rlhf_trainer.api.lora import lora_rules
from rlhf_trainer.api.rules import Rule, SpecModel
from rlhf_trainer.api.sections import (
    DataConfig,
    GenerationConfig,
    ModelsConfig,
    OutputConfig,
    TrainerConfig,
)

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


class Device(StrEnum):
    GPU = "gpu"
    CPU = "cpu"  # a slot per rank, computing on CPU cores: try the operator on any cluster


class PoolConfig(SpecModel):
    """A named group of GPU nodes. Roles mapped to the same pool take turns on its GPUs."""

    name: PoolName
    replicas: int = Field(1, ge=1, le=512, description="Nodes in this pool.")
    gpus_per_node: int = Field(
        8, ge=1, le=16, description="GPUs used on each node of this pool (at least 1)."
    )
    # The trainer reads it too: the weight transfer follows it (api.transfer).
    device: Device = Field(
        Device.GPU,
        description=(
            "gpu: each of gpusPerNode is a GPU (gpuResource). cpu: each is a slot of CPU "
            "cores, and the pool asks for no GPU; Ray still sees one logical GPU per slot, so "
            "roles place and colocate as on GPUs, and compute on CPU (a trial on any cluster)."
        ),
    )
    gpu_memory_gib: float | None = Field(
        None,
        alias="gpuMemoryGiB",
        gt=0,
        le=4096,
        description=(
            "Memory of each GPU of this pool, in GiB (an 80 GB H100: 79.6, as nvidia-smi "
            "shows it). Admission refuses a placement whose roles cannot fit it (the memory "
            "per GPU that `rlhfjob plan` shows); unset: unknown, nothing is refused."
        ),
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
    critic: PoolName | None = Field(
        None,
        description=(
            "Pool of the critic (value model). Required exactly when "
            "algorithm.advantageEstimator is gae; the critic-free estimators have none."
        ),
    )
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


def _pool_gpus(config: JobConfig, pool: str | None) -> int | None:
    """GPUs of the named pool, or None when it is not declared."""
    return next((p.total_gpus for p in config.pools if p.name == pool), None)


def _pool_has_role(config: JobConfig, pool: str) -> bool:
    return pool in config.roles.pools_in_use().values()


def _critic_rules() -> tuple[Rule, ...]:
    """The critic exactly when the estimator needs one."""
    return (
        Rule(
            "roles.critic",
            "is required when algorithm.advantageEstimator is gae, and must be unset "
            "otherwise (the critic-free estimators have no critic)",
            "has(self.roles.critic) == (self.algorithm.advantageEstimator == 'gae')",
            lambda c: (c.roles.critic is not None) == c.algorithm.uses_critic,
            lambda c: f"advantageEstimator {c.algorithm.advantage_estimator}",
        ),
        Rule(
            "models.critic",
            "must be unset unless algorithm.advantageEstimator is gae (no critic runs)",
            "!has(self.models.critic) || self.algorithm.advantageEstimator == 'gae'",
            lambda c: c.models.critic is None or c.algorithm.uses_critic,
        ),
    )


def _group_rules() -> tuple[Rule, ...]:
    """Groups of responses where the algorithm compares them."""
    group_estimators = ", ".join(f"'{e}'" for e in GROUP_ESTIMATORS)
    return (
        Rule(
            "generation.samplesPerPrompt",
            f"must be at least 2 for the estimators {group_estimators} "
            "(they compare the responses to one prompt)",
            f"self.algorithm.advantageEstimator in [{group_estimators}] "
            "? self.generation.samplesPerPrompt >= 2 : true",
            lambda c: (
                c.algorithm.advantage_estimator not in GROUP_ESTIMATORS
                or c.generation.samples_per_prompt >= 2
            ),
            lambda c: (
                f"got {c.generation.samples_per_prompt} with {c.algorithm.advantage_estimator}"
            ),
        ),
        Rule(
            "algorithm.dynamicSampling",
            "needs generation.samplesPerPrompt >= 2 (it drops groups whose rewards are all "
            "equal, and one response is always such a group)",
            "!has(self.algorithm.dynamicSampling) || self.generation.samplesPerPrompt >= 2",
            lambda c: c.algorithm.dynamic_sampling is None or c.generation.samples_per_prompt >= 2,
        ),
        # Here rather than on AlgorithmConfig: the API server checks a node's rules
        # against its default too, and the algorithm's default ({}) has no clipRatio.
        Rule(
            "algorithm.clipRatioHigh",
            "must be at least clipRatioLow (each defaults to clipRatio)",
            "(has(self.algorithm.clipRatioHigh) ? self.algorithm.clipRatioHigh "
            ": self.algorithm.clipRatio) >= (has(self.algorithm.clipRatioLow) "
            "? self.algorithm.clipRatioLow : self.algorithm.clipRatio)",
            lambda c: c.algorithm.clip_range()[1] >= c.algorithm.clip_range()[0],
            lambda c: "low {}, high {}".format(*c.algorithm.clip_range()),
        ),
    )


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
        # has() inside the filter: the pool of an optional role (critic) may be unset
        f"self.pools.filter(p, has(self.roles.{r}) && p.name == self.roles.{r}).all(p, "
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
    "[self.roles.actor, self.roles.rollout]"
    " + (has(self.roles.critic) ? [self.roles.critic] : [])"
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
    output: OutputConfig | None = Field(
        None,
        description=(
            "Write the trained policy as a Hugging Face directory (at the end, and every "
            "trainer.export.everySteps); unset: only checkpoints (a local run: its run folder's "
            "model/)."
        ),
    )
    environments: list[EnvironmentConfig] = Field(
        default_factory=list,
        max_length=16,
        description="Environment servers that multi-turn episodes run in; names must be unique.",
        json_schema_extra=POOLS_LIST_MAP,
    )
    agents: list[AgentConfig] = Field(
        default_factory=list,
        max_length=16,
        description="Agent services that generation.agent episodes run on; names must be unique.",
        json_schema_extra=POOLS_LIST_MAP,
    )

    rules = (
        Rule(
            "pools",
            "pool names must be unique",
            "self.pools.all(p, self.pools.exists_one(q, q.name == p.name))",
            lambda c: len({p.name for p in c.pools}) == len(c.pools),
        ),
        *(_declared_pool_rule(r, optional=False) for r in (Role.ACTOR, Role.ROLLOUT)),
        *(_declared_pool_rule(r, optional=True) for r in (Role.CRITIC, Role.REF, Role.REWARD)),
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
            "trainer.evalEverySteps",
            "needs data.eval (the held-out prompts it scores)",
            "!has(self.trainer.evalEverySteps) || has(self.data.eval)",
            lambda c: c.trainer.eval_every_steps is None or c.data.eval is not None,
        ),
        Rule(
            "trainer.export.everySteps",
            "needs output (where the policy is written)",
            "!has(self.trainer.export) || !has(self.trainer.export.everySteps) || has(self.output)",
            lambda c: c.trainer.export.every_steps is None or c.output is not None,
        ),
        *_critic_rules(),
        *_group_rules(),
        *multi_turn_rules(),
        *agent_rules(),
        *lora_rules(),
        Rule(
            "trainer.miniBatchSize",
            "must divide trainer.batchSize x generation.samplesPerPrompt (the samples of a step)",
            "(self.trainer.batchSize * self.generation.samplesPerPrompt) "
            "% self.trainer.miniBatchSize == 0",
            lambda c: c.samples_per_step % c.trainer.mini_batch_size == 0,
            lambda c: f"miniBatchSize {c.trainer.mini_batch_size}, {c.samples_per_step} samples",
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

    @property
    def elastic_pools(self) -> frozenset[str]:
        """The pools whose size may change while the job trains: fully async's rollout
        pool when nothing else runs on it (its engines come and go, loop.membership).
        A pool with a trained or scoring role changes size by a new attempt instead."""
        rollout = self.roles.rollout
        others = {pool for role, pool in self.roles.pools_in_use().items() if role != Role.ROLLOUT}
        elastic = self.async_ is not None and rollout not in others
        return frozenset({rollout}) if elastic else frozenset()

    @property
    def multi_turn(self) -> MultiTurnConfig | None:
        return self.generation.multi_turn

    def environment(self, name: str) -> EnvironmentConfig:
        return next(e for e in self.environments if e.name == name)

    def agent(self, name: str) -> AgentConfig:
        return next(a for a in self.agents if a.name == name)

    @property
    def samples_per_step(self) -> int:
        """The samples a step trains on: batchSize prompts x samplesPerPrompt responses."""
        return self.trainer.batch_size * self.generation.samples_per_prompt
