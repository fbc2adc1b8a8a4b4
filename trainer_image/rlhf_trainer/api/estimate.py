"""The placement estimator: a job's step time, each pool's busy share and samples/s,
predicted from a cost model, and the pool split that balances the pools.

Pure, like the plan it reads: a JobConfig and a CostProfile in, an Estimate out. The
cost model is a rate per GPU for each kind of work, measured once for a model on a kind
of GPU (bench/README.md says how; `rlhf_trainer/api/profiles/` holds the measured ones):

    generate                        samples x responseTokens          / (generate rate x GPUs)
                                    (synchronous: at least maxResponseLength / decode rate
                                    of one sequence, as a batch waits for its longest)
    actor/ref log-probs, values,    samples x (prompt + response)     / (forward rate x GPUs)
      a reward model
    actor and critic updates        epochs x samples x (prompt + resp) / (train rate x GPUs)
    weight sync                     modelGigabytes / weightSyncGigabytesPerSecond
                                    (fully async: once every triggerParameterSyncStep steps)

LoRA (models.actor.lora, models.critic.lora): a sync moves only the adapter, sized from
the decoder's linear layers (the tiny model's own, or the profile's modelShape), at the
engines' dtype; an update of a LoRA'd model costs loraTrainCost of a full one.

The plan then overlaps the phases as the job's placement allows (PlacementPlan.step_seconds),
each slowed by `concurrentSlowdown` when it runs beside another pool's work (pools that
share a host; 1 on real GPUs), and the driver's own seconds are added to the trainer's
side. Rates scale linearly with a role's GPUs: calibrate at the pool sizes you plan for.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.lora import LoraConfig
from rlhf_trainer.api.memory import trained_rows
from rlhf_trainer.api.plan import DRIVER, Phase, PlacementPlan, plan_placement
from rlhf_trainer.api.rules import SpecModel
from rlhf_trainer.api.shape import ModelShape

FORWARD_PHASES = (Phase.ACTOR_LOG_PROB, Phase.REF_LOG_PROB, Phase.VALUES, Phase.REWARD)
TRAIN_PHASES = (Phase.UPDATE_ACTOR, Phase.UPDATE_CRITIC)
MAX_CANDIDATE_SPLITS = 20_000  # pool splits tried by suggest_split, at most
# Bytes of a synced parameter: the engines serve the trainer's compute dtype
# (trainer.precision; rlhf_trainer.models.COMPUTE_DTYPE).
SYNC_BYTES = {"fp32": 4, "bf16": 2}


class CostProfile(SpecModel):
    """Per-GPU rates of one model on one kind of GPU, with the workload's mean lengths."""

    source: str = Field(description="Where and how the rates were measured.")
    prompt_tokens: float = Field(gt=0, description="Mean prompt tokens per sample.")
    response_tokens: float = Field(gt=0, description="Mean response tokens per sample.")
    generate_tokens_per_second: float = Field(
        gt=0, description="Response tokens generated per second per GPU."
    )
    forward_tokens_per_second: float = Field(
        gt=0, description="Tokens scored per second per GPU (log-probs, values, reward)."
    )
    train_tokens_per_second: float = Field(
        gt=0, description="Tokens trained on per second per GPU, per epoch."
    )
    decode_tokens_per_second_per_sequence: float | None = Field(
        None,
        gt=0,
        description=(
            "One sequence's decode speed: a synchronous batch waits for its longest "
            "response, so its generation takes at least maxResponseLength / this (unset: "
            "no such floor)."
        ),
    )
    model_gigabytes: float = Field(ge=0, description="The policy's weights as synced.")
    weight_sync_gigabytes_per_second: float = Field(
        gt=0, description="Actor-to-engines weight-sync bandwidth."
    )
    driver_seconds: float = Field(
        0.0, ge=0, description="The driver's own seconds a step (packing, advantages, rules)."
    )
    role_cost: dict[Role, float] = Field(
        default_factory=dict,
        description=(
            "A role's cost per token against the actor's model (e.g. critic: 0.1 for a 0.5B "
            "critic beside a 7B actor); 1 for a role not named."
        ),
    )
    concurrent_slowdown: float = Field(
        1.0, ge=1, description="How much slower a phase runs beside another pool's work."
    )
    model_shape: ModelShape | None = Field(
        None, description="The model's linear layers, to size a LoRA adapter (not a tiny one)."
    )
    lora_train_cost: float = Field(
        0.67,
        gt=0,
        description=(
            "A LoRA'd model's update seconds against a full update's: no weight gradients "
            "for the frozen base, about 2/3 of the work (a small model on a CPU measured more)."
        ),
    )


@dataclass(frozen=True)
class Estimate:
    step_seconds: float
    samples_per_second: float
    busy: Mapping[str, float]  # pool -> share of a step in which its GPUs work
    phase_seconds: Mapping[Phase, float]  # a step's seconds per phase, as overlapped


def bundled_profiles() -> list[str]:
    folder = resources.files("rlhf_trainer.api") / "profiles"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def load_profile(name_or_path: str) -> CostProfile:
    """A bundled profile by name, or a YAML file; ValueError names what is wrong."""
    path = Path(name_or_path)
    if name_or_path in bundled_profiles():
        text = (
            resources.files("rlhf_trainer.api") / "profiles" / f"{name_or_path}.yaml"
        ).read_text()
    elif path.is_file():
        text = path.read_text()
    else:
        known = ", ".join(bundled_profiles())
        raise ValueError(f"profile {name_or_path!r}: no such file or bundled profile ({known})")
    try:
        return CostProfile.model_validate(yaml.safe_load(text))
    except ValidationError as invalid:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in invalid.errors()
        )
        raise ValueError(f"profile {name_or_path}: {problems}") from None


def alone_seconds(
    config: JobConfig, profile: CostProfile, plan: PlacementPlan
) -> dict[Phase, float]:
    """Each phase's seconds a step when it runs alone on its role's GPUs."""
    samples = config.samples_per_step
    # What the pools score and train: an agent episode's samples, up to its bound each.
    tokens = trained_rows(config) * (profile.prompt_tokens + profile.response_tokens)
    rate = {
        Phase.GENERATE: profile.generate_tokens_per_second,
        **dict.fromkeys(FORWARD_PHASES, profile.forward_tokens_per_second),
        **dict.fromkeys(TRAIN_PHASES, profile.train_tokens_per_second / config.trainer.epochs),
    }
    work = dict.fromkeys(rate, tokens) | {Phase.GENERATE: samples * profile.response_tokens}
    seconds: dict[Phase, float] = {}
    for phase in plan.phases():
        role_name = plan.phase_role[phase]
        role = plan.roles[role_name]
        if phase is Phase.SYNC_WEIGHTS:
            every = config.async_.trigger_parameter_sync_step if config.async_ else 1
            gigabytes = sync_gigabytes(config, profile)
            seconds[phase] = gigabytes / profile.weight_sync_gigabytes_per_second / every
        elif role.pool != DRIVER:  # a rule-based reward is the driver's own time
            cost = profile.role_cost.get(role_name, 1.0)
            if phase in TRAIN_PHASES and trained_lora(config, role_name) is not None:
                cost *= profile.lora_train_cost
            seconds[phase] = cost * work[phase] / (rate[phase] * role.gpus)
    longest = config.data.max_response_length
    if profile.decode_tokens_per_second_per_sequence and not plan.background:
        floor = longest / profile.decode_tokens_per_second_per_sequence
        seconds[Phase.GENERATE] = max(seconds[Phase.GENERATE], floor)
    return seconds


def trained_lora(config: JobConfig, role: Role) -> LoraConfig | None:
    """The adapter `role` trains, if it is the actor or the critic and its model is LoRA'd."""
    model = {Role.ACTOR: config.models.actor, Role.CRITIC: config.models.critic}.get(role)
    return model.lora if model is not None else None


def sync_gigabytes(config: JobConfig, profile: CostProfile) -> float:
    """What a weight sync moves: the policy's weights, or its LoRA adapter."""
    lora = config.models.actor.lora
    if lora is None:
        return profile.model_gigabytes
    tiny = config.models.actor.tiny
    shape = tiny.shape() if tiny is not None else profile.model_shape
    if shape is None:
        raise ValueError(
            f"profile {profile.source!r}: a LoRA job's sync moves only the adapter, sized "
            "from the model: set modelShape (layers, hiddenSize, intermediateSize, kvSize, "
            "vocabSize)"
        )
    return shape.adapter_parameters(lora) * SYNC_BYTES[config.trainer.precision] / 1e9


def estimate(config: JobConfig, profile: CostProfile) -> Estimate:
    plan = plan_placement(config)
    alone = alone_seconds(config, profile, plan)
    seconds = {
        phase: time * (profile.concurrent_slowdown if _overlapped(plan, phase, alone) else 1.0)
        for phase, time in alone.items()
    }
    step = plan.step_seconds(seconds, driver=profile.driver_seconds)
    busy = dict.fromkeys((p.name for p in plan.pools), 0.0)
    for lane in plan.lanes():
        if lane.pool != DRIVER:
            busy[lane.pool] += lane.seconds(seconds) / step
    return Estimate(step, config.samples_per_step / step, busy, seconds)


def _overlapped(plan: PlacementPlan, phase: Phase, pool_phases: Mapping[Phase, float]) -> bool:
    """Whether another pool's phase runs beside this one (the driver's do not count)."""
    return any(plan.concurrent(phase, other) for other in pool_phases if other is not phase)


def suggest_split(
    config: JobConfig, profile: CostProfile, share_nodes: bool = False
) -> tuple[JobConfig, Estimate] | None:
    """The split of the job's GPUs over its pools with the shortest estimated step (see
    `_splits`; splits the spec's rules reject, e.g. on tensor parallelism, are skipped).
    None for a single pool."""
    if len(config.pools) < 2:
        return None
    best: tuple[JobConfig, Estimate] | None = None
    for shape in itertools.islice(_splits(config, share_nodes), MAX_CANDIDATE_SPLITS):
        candidate = _reshaped(config, shape)
        if candidate is None:
            continue
        guess = estimate(candidate, profile)
        if best is None or guess.step_seconds < best[1].step_seconds:
            best = (candidate, guess)
    return best


Shape = tuple[tuple[int, int], ...]  # (nodes, GPUs per node) per pool


def rollout_pool_sizes(config: JobConfig, profile: CostProfile) -> list[tuple[int, Estimate]]:
    """A fully-async job's estimate with its rollout pool at other node counts (it is
    elastic: `replicas` may change while the job runs): one node less, one more, twice
    as many. [] when the rollout shares its pool with a trained role, or is not async."""
    pool_of = config.roles.rollout
    shared = {config.roles.actor, config.roles.critic, config.roles.ref} - {None}
    if config.async_ is None or pool_of in shared:
        return []
    (pool,) = [p for p in config.pools if p.name == pool_of]
    sizes = sorted({pool.replicas - 1, pool.replicas + 1, 2 * pool.replicas} - {0})
    shape = {p.name: (p.replicas, p.gpus_per_node) for p in config.pools}
    found = []
    for nodes in sizes:
        reshaped = _reshaped(config, tuple((nodes, n[1]) if name == pool_of else n
                                           for name, n in shape.items()))  # fmt: skip
        if reshaped is not None:
            found.append((nodes, estimate(reshaped, profile)))
    return found


def _splits(config: JobConfig, share_nodes: bool) -> Iterator[Shape]:
    """Pool shapes on the job's GPUs: each pool's node count at its GPUs per node; and
    when the pools share their nodes (`separation: gpu`, the same node count each),
    each node's GPUs shared out anew (4+4 -> 6+2 on one 8-GPU node)."""
    per_node = [p.gpus_per_node for p in config.pools]
    total = sum(p.total_gpus for p in config.pools)
    for nodes in _partitions(total, per_node):
        yield tuple(zip(nodes, per_node, strict=True))
    replicas = {p.replicas for p in config.pools}
    if share_nodes and len(replicas) == 1:
        (shared,) = replicas
        for gpus in _partitions(sum(per_node), [1] * len(per_node)):
            yield tuple((shared, g) for g in gpus)


def _partitions(total: int, units: list[int]) -> Iterator[tuple[int, ...]]:
    """Counts c_i >= 1 with sum(c_i x units_i) = total."""
    ranges = [range(1, total // unit + 1) for unit in units[:-1]]
    for head in itertools.product(*ranges):
        rest = total - sum(c * u for c, u in zip(head, units, strict=False))
        if rest > 0 and rest % units[-1] == 0:
            yield (*head, rest // units[-1])


def _reshaped(config: JobConfig, shape: Shape) -> JobConfig | None:
    spec = config.model_dump(by_alias=True, exclude_none=True)
    for pool, (nodes, gpus) in zip(spec["pools"], shape, strict=True):
        pool["replicas"], pool["gpusPerNode"] = nodes, gpus
    try:
        return JobConfig.model_validate(spec)
    except ValidationError:
        return None


def calibrate(
    config: JobConfig,
    phase_seconds: Mapping[str, float],
    driver_seconds: float,
    like: CostProfile,
) -> CostProfile:
    """The rates a run measured: its mean seconds per phase (run one after another, as
    in a colocated or synchronous step) and the driver's own seconds a step. The lengths,
    the model size and the slowdown beside another pool come from `like`."""
    plan = plan_placement(config)
    unit = like.model_copy(
        update={
            "generate_tokens_per_second": 1.0,
            "forward_tokens_per_second": 1.0,
            "train_tokens_per_second": 1.0,
            "weight_sync_gigabytes_per_second": 1.0,
            "decode_tokens_per_second_per_sequence": None,
        }
    )
    at_unit_rate = alone_seconds(config, unit, plan)  # seconds x rate: the work of each phase

    def rate(*phases: Phase) -> float:
        ran = [p for p in phases if p in at_unit_rate]
        measured = sum(phase_seconds.get(p, 0.0) for p in ran)
        work = sum(at_unit_rate[p] for p in ran)
        if measured <= 0 or work <= 0:
            raise ValueError(f"calibrate: no work or no time measured for {', '.join(ran)}")
        return work / measured

    return like.model_copy(
        update={
            "generate_tokens_per_second": rate(Phase.GENERATE),
            "forward_tokens_per_second": rate(*FORWARD_PHASES),
            "train_tokens_per_second": rate(*TRAIN_PHASES),
            "weight_sync_gigabytes_per_second": rate(Phase.SYNC_WEIGHTS),
            "driver_seconds": driver_seconds,
        }
    )


def describe_estimate(config: JobConfig, profile: CostProfile, share_nodes: bool = False) -> str:
    """The estimate as a person reads it, and the split to try (`share_nodes`: the
    pools split each node's GPUs, as with `separation: gpu`)."""
    guess, lanes = estimate(config, profile), plan_placement(config).lanes()
    lines = [
        f"estimate (rates: {profile.source}):",
        f"  step {guess.step_seconds:.3g} s, {guess.samples_per_second:.3g} samples/s",
    ]
    for pool, share in guess.busy.items():
        phases = [
            f"{p} {guess.phase_seconds[p]:.3g} s"
            for lane in lanes
            if lane.pool == pool
            for p in lane.phases
        ]
        lines.append(f"  pool {pool}: busy {share:.0%} ({', '.join(phases)})")
    if (lora := config.models.actor.lora) is not None:
        lines.append(
            f"  LoRA rank {lora.rank}: a sync moves the adapter, "
            f"{1e3 * sync_gigabytes(config, profile):.3g} MB (the model: "
            f"{1e3 * profile.model_gigabytes:.3g} MB); updates at {profile.lora_train_cost:.2f} "
            "of a full one's"
        )
    suggestion = suggest_split(config, profile, share_nodes)
    if suggestion is not None:
        better, best = suggestion
        nodes = ", ".join(f"{p.name} {p.replicas} x {p.gpus_per_node} GPUs" for p in better.pools)
        gain = guess.step_seconds / best.step_seconds
        lines.append(f"  balanced split: {nodes}: step {best.step_seconds:.3g} s ({gain:.2f}x)")
    if sizes := rollout_pool_sizes(config, profile):
        steps = ", ".join(f"{n} node(s) {e.step_seconds:.3g} s" for n, e in sizes)
        lines.append(f"  rollout pool resized while it runs: step at {steps}")
    return "\n".join(lines)
