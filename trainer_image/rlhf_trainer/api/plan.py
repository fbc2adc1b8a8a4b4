"""The placement plan: which role runs where, and which phases of a PPO step overlap.

Pure: a JobConfig in, a PlacementPlan out. The trainer turns it into Ray placement
groups and a step schedule; the operator uses it for status; benchmarks use
`step_seconds` to compute the ideal speedup of a layout.

A step is a sequence of stages. Within a stage, each pool runs its phases one after
another (a lane), and the lanes of different pools run at the same time:

    generate | score: (actor/ref log-probs ∥ values ∥ reward) | update: (actor ∥ critic) | sync

In fully async mode generation leaves the step: it runs continuously on the rollout
pool (the background lane) while the trainer pools run the other stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from rlhf_trainer.api.config import JobConfig, Role


class Phase(StrEnum):
    GENERATE = "generate"
    ACTOR_LOG_PROB = "actor_log_prob"  # the trainer's log π_old(a|s), for the PPO ratio
    REF_LOG_PROB = "ref_log_prob"
    VALUES = "values"
    REWARD = "reward"
    UPDATE_ACTOR = "update_actor"
    UPDATE_CRITIC = "update_critic"
    SYNC_WEIGHTS = "sync_weights"  # actor -> rollout engines


# The role whose pool a phase runs on. SYNC_WEIGHTS also touches the rollout pool, but
# it is driven from the actor's ranks and stands alone in its stage.
PHASE_ROLE: dict[Phase, Role] = {
    Phase.GENERATE: Role.ROLLOUT,
    Phase.ACTOR_LOG_PROB: Role.ACTOR,
    Phase.REF_LOG_PROB: Role.REF,
    Phase.VALUES: Role.CRITIC,
    Phase.REWARD: Role.REWARD,
    Phase.UPDATE_ACTOR: Role.ACTOR,
    Phase.UPDATE_CRITIC: Role.CRITIC,
    Phase.SYNC_WEIGHTS: Role.ACTOR,
}

STEP_STAGES: tuple[tuple[str, tuple[Phase, ...]], ...] = (
    ("generate", (Phase.GENERATE,)),
    ("score", (Phase.ACTOR_LOG_PROB, Phase.REF_LOG_PROB, Phase.VALUES, Phase.REWARD)),
    ("update", (Phase.UPDATE_ACTOR, Phase.UPDATE_CRITIC)),
    ("sync", (Phase.SYNC_WEIGHTS,)),
)

DRIVER = "driver"  # not a pool: a rule-based reward runs on the driver's CPU


class Mode(StrEnum):
    COLOCATED = "colocated"  # every role on one pool, phases one after another
    SPLIT = "split"  # roles over several pools, independent phases at the same time
    ASYNC = "async"  # rollout on its own pool, streaming to the trainer pools


@dataclass(frozen=True)
class PoolPlan:
    name: str
    nodes: int
    gpus_per_node: int
    total_gpus: int
    roles: tuple[Role, ...]  # colocated roles, which take turns on these GPUs


@dataclass(frozen=True)
class RolePlan:
    role: Role
    pool: str  # a pool name, or DRIVER
    gpus: int  # GPUs the role's workers use (all of the pool's)
    data_parallel_size: int  # workers (rollout: engines of tensor_parallel_size GPUs)
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class Lane:
    """Phases that run one after another on one pool."""

    pool: str
    phases: tuple[Phase, ...]

    def seconds(self, phase_seconds: Mapping[Phase, float]) -> float:
        return sum(phase_seconds.get(p, 0.0) for p in self.phases)


@dataclass(frozen=True)
class Stage:
    """Lanes that run at the same time."""

    name: str
    lanes: tuple[Lane, ...]


@dataclass(frozen=True)
class PlacementPlan:
    mode: Mode
    pools: tuple[PoolPlan, ...]
    roles: Mapping[Role, RolePlan]
    stages: tuple[Stage, ...]  # one PPO step, in order
    background: tuple[Lane, ...]  # runs throughout (async generation)
    # Whose workers run each phase: PHASE_ROLE's, but for `phase_roles`' exception.
    phase_role: Mapping[Phase, Role] = field(default_factory=lambda: dict(PHASE_ROLE))

    @property
    def total_gpus(self) -> int:
        return sum(p.total_gpus for p in self.pools)

    def stage(self, name: str) -> Stage:
        """The step's stage `name`, with no lanes when none of its roles runs on a pool
        (or, for "generate" in fully async mode, when it runs in the background)."""
        if name not in dict(STEP_STAGES):
            raise KeyError(f"no stage {name!r} in a step: {', '.join(dict(STEP_STAGES))}")
        return next((s for s in self.stages if s.name == name), Stage(name, ()))

    def phases(self) -> tuple[Phase, ...]:
        return tuple(phase for lane in self.lanes() for phase in lane.phases)

    def concurrent(self, a: Phase, b: Phase) -> bool:
        """Whether phases a and b can run at the same time in this plan."""
        background = {p for lane in self.background for p in lane.phases}
        if (a in background) != (b in background):
            return True  # background generation overlaps every trainer phase
        for stage in self.stages:
            lane_of = {p: lane.pool for lane in stage.lanes for p in lane.phases}
            if a in lane_of and b in lane_of:
                return lane_of[a] != lane_of[b]
        return False

    def step_seconds(self, phase_seconds: Mapping[Phase, float], driver: float = 0.0) -> float:
        """Ideal time of one step given each phase's time when run alone, and the
        driver's own seconds a step (they add to the trainer stages' time).

        Sum over stages of the slowest lane; with background generation the step
        takes whichever is slower, the trainer stages or the generation they consume.
        """
        stages = (max(lane.seconds(phase_seconds) for lane in s.lanes) for s in self.stages)
        trainer = driver + sum(stages)
        return max([trainer, *(lane.seconds(phase_seconds) for lane in self.background)])

    def lanes(self) -> tuple[Lane, ...]:
        """Every lane of a step: the background's, then each stage's."""
        return self.background + tuple(lane for s in self.stages for lane in s.lanes)


def plan_placement(config: JobConfig) -> PlacementPlan:
    role_pool = config.roles.pools_in_use()
    pools = tuple(
        PoolPlan(
            name=p.name,
            nodes=p.replicas,
            gpus_per_node=p.gpus_per_node,
            total_gpus=p.total_gpus,
            roles=tuple(r for r in Role if role_pool.get(r) == p.name),
        )
        for p in config.pools
    )
    roles = {r: _role_plan(config, r, role_pool.get(r)) for r in _active_roles(config)}
    phase_role = phase_roles(config)
    mode = (
        Mode.ASYNC if config.async_ is not None
        else Mode.COLOCATED if len(pools) == 1
        else Mode.SPLIT
    )  # fmt: skip
    background: tuple[Lane, ...] = ()
    stages = []
    # With the rollout's log-probs as log π_old, the actor does not score the batch.
    skipped = {Phase.ACTOR_LOG_PROB} if config.algorithm.old_log_probs == "rollout" else set()
    for name, stage_phases in STEP_STAGES:
        phases = [p for p in stage_phases if phase_role[p] in roles and p not in skipped]
        if mode is Mode.ASYNC and Phase.GENERATE in phases:
            background = (Lane(roles[Role.ROLLOUT].pool, (Phase.GENERATE,)),)
            continue
        if phases:
            stages.append(Stage(name, _lanes(phases, roles, phase_role)))
    return PlacementPlan(mode, pools, roles, tuple(stages), background, phase_role)


def ref_answered_by_actor(config: JobConfig) -> bool:
    """Whether the actor's ranks answer the ref's log-probs, so that no ref worker starts:
    - a LoRA'd actor whose ref is its own base (`ModelsConfig.ref_is_actor_base`), with
      its adapter off: no second copy of the model;
    - a ref on the actor's pool: each actor rank holds the frozen ref beside the policy.
      It is on the same GPUs either way, and the two took turns on them already; a
      process of its own cost one more CUDA context and one more start a rank.
    Without roles.ref (no KL) there is no ref phase to answer."""
    ref_pool = config.roles.ref
    return ref_pool is not None and (
        config.models.ref_is_actor_base or ref_pool == config.roles.actor
    )


def in_actor_processes(plan: PlacementPlan) -> list[Role]:
    """The roles on the actor's pool whose ranks live in the actor's processes, each
    with its own model (and optimizer) on its rank's GPUs: the critic and a reward
    model. Their ranks are the actor's (a pool's roles take all of its GPUs), and they
    took turns on those GPUs already; a process of their own cost one more start (its
    imports alone: ~5 CPU-s on a CPU here) and one more CUDA context a GPU. The rollout
    keeps its own: vLLM makes its own processes and process group."""
    actor = plan.roles[Role.ACTOR].pool
    return [
        role
        for role in (Role.CRITIC, Role.REWARD)
        if getattr(plan.roles.get(role), "pool", None) == actor
    ]


def roles_with_processes(plan: PlacementPlan) -> list[Role]:
    """The roles whose ranks are processes of their own on their pool: every role on a
    pool but those in the actor's processes (`in_actor_processes`)."""
    beside_actor = in_actor_processes(plan)
    return [r for r, p in plan.roles.items() if p.pool != DRIVER and r not in beside_actor]


def phase_roles(config: JobConfig) -> dict[Phase, Role]:
    """Whose workers run each phase: PHASE_ROLE, except the ref's log-probs when the
    actor's ranks answer them (`ref_answered_by_actor`)."""
    if ref_answered_by_actor(config):
        return PHASE_ROLE | {Phase.REF_LOG_PROB: Role.ACTOR}
    return dict(PHASE_ROLE)


def _active_roles(config: JobConfig) -> list[Role]:
    """Every role but a ref without a pool (no KL) or answered by the actor, and a
    critic without a pool (critic-free estimators); the reward always runs, on a pool
    or on the driver."""
    optional = {Role.REF: config.roles.ref, Role.CRITIC: config.roles.critic}
    if ref_answered_by_actor(config):
        optional[Role.REF] = None
    return [r for r in Role if r not in optional or optional[r] is not None]


def _role_plan(config: JobConfig, role: Role, pool: str | None) -> RolePlan:
    if pool is None:  # the reward as a rule-based function
        return RolePlan(role, DRIVER, gpus=0, data_parallel_size=1)
    gpus = config.pool(pool).total_gpus
    tp = config.generation.tensor_parallel_size if role is Role.ROLLOUT else 1
    return RolePlan(role, pool, gpus, data_parallel_size=gpus // tp, tensor_parallel_size=tp)


def _lanes(
    phases: list[Phase], roles: Mapping[Role, RolePlan], phase_role: Mapping[Phase, Role]
) -> tuple[Lane, ...]:
    by_pool: dict[str, list[Phase]] = {}
    for phase in phases:
        by_pool.setdefault(roles[phase_role[phase]].pool, []).append(phase)
    return tuple(Lane(pool, tuple(ps)) for pool, ps in by_pool.items())


def describe(plan: PlacementPlan) -> str:
    """The plan as a person reads it: pools, then one line per stage of a step."""
    lines = [f"mode: {plan.mode}, {plan.total_gpus} GPUs in {len(plan.pools)} pool(s)"]
    for p in plan.pools:
        lines.append(
            f"  pool {p.name}: {p.nodes} node(s) x {p.gpus_per_node} GPU(s) = {p.total_gpus}"
            f"  roles: {', '.join(p.roles)}"
        )
    for role in plan.roles.values():
        dp = f"dp={role.data_parallel_size}" + (
            f" x tp={role.tensor_parallel_size}" if role.tensor_parallel_size > 1 else ""
        )
        where = "driver CPU (no model)" if role.pool == DRIVER else f"{role.pool}, {dp}"
        beside = ", in the actor's processes" if role.role in in_actor_processes(plan) else ""
        lines.append(f"  {role.role}: {where}{beside}")
    if plan.phase_role[Phase.REF_LOG_PROB] is Role.ACTOR:
        lines.append("  ref: on the actor's ranks (a frozen copy, or its base with LoRA off)")
    lines.append("one step (' || ' = at the same time, ' -> ' = one after another):")
    for lane in plan.background:
        lines.append(f"  background  {_lane_text(lane)}  (overlaps every stage)")
    for stage in plan.stages:
        lines.append(f"  {stage.name:<10}  " + " || ".join(map(_lane_text, stage.lanes)))
    return "\n".join(lines)


def _lane_text(lane: Lane) -> str:
    return f"{lane.pool}: " + " -> ".join(lane.phases)
