"""What the memory plan (api.memory) says: the admission rule that refuses a placement
that cannot fit, naming the pool and the figures, and the table `rlhfjob plan` prints."""

from __future__ import annotations

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.memory import (
    GIB,
    PoolMemory,
    RoleMemory,
    kv_bytes_per_token,
    memory_plan,
    model_shape,
    nccl_receive_bytes,
    sequence_tokens,
)
from rlhf_trainer.api.rules import FieldError


def memory_errors(config: JobConfig) -> list[FieldError]:
    """The admission rule: each pool whose known roles need more of a GPU than it has,
    and engines whose share of a GPU cannot hold their weights and one whole sequence's
    KV cache (vLLM refuses to start). Unknown figures refuse nothing."""
    errors = []
    for pool in memory_plan(config):
        if pool.overflows:
            roles = "; ".join(map(_role_sum, pool.roles))
            errors.append(FieldError(
                f"pools[{pool.index}]",
                f"pool {pool.name!r} cannot fit its roles: they need {_gib(pool.need_bytes)} "
                f"GiB of each GPU, which has {_gib(pool.gpu_bytes or 0)} (gpuMemoryGiB): "
                f"{roles} (`rlhfjob plan` shows the terms)",
            ))  # fmt: skip
        errors += _engine_errors(config, pool)
    return errors


def _engine_errors(config: JobConfig, pool: PoolMemory) -> list[FieldError]:
    rollout = next((r for r in pool.roles if r.role is Role.ROLLOUT), None)
    shape = model_shape(config, Role.ACTOR)
    if rollout is None or pool.gpu_bytes is None or shape is None:
        return []
    share = int(config.generation.gpu_memory_utilization * pool.gpu_bytes)
    sequence = sequence_tokens(config) * kv_bytes_per_token(config, shape)
    if rollout.kv_cache_bytes >= sequence:  # the share less its weights and NCCL buffers
        return []
    buffers = nccl_receive_bytes(config)
    also = f", the NCCL buffers ({_gib(buffers)} GiB)" if buffers else ""
    return [FieldError(
        "generation.gpuMemoryUtilization",
        f"gives each engine GPU of pool {pool.name!r} {_gib(share)} GiB, which cannot hold "
        f"its weights ({_gib(rollout.weights_bytes)} GiB){also} and the KV cache of one "
        f"{sequence_tokens(config)}-token sequence ({_gib(sequence)} GiB)",
    )]  # fmt: skip


TERMS = (
    ("weights", "weights_bytes"),
    ("gradients", "gradients_bytes"),
    ("optimizer", "optimizer_bytes"),
    ("KV cache", "kv_cache_bytes"),
    ("runtime", "runtime_bytes"),
    ("activations", "activation_bytes"),
    ("step", "step_bytes"),
    ("transfer", "transfer_bytes"),
)


def _gib(value: int) -> str:
    return f"{value / GIB:.3g}"


def _role_sum(role: RoleMemory) -> str:
    terms = ", ".join(
        f"{name} {_gib(getattr(role, attr))}" for name, attr in TERMS if getattr(role, attr)
    )
    return f"{role.role}: {terms}"


def describe_memory(config: JobConfig) -> str:
    """The memory per GPU as a person reads it: a table a pool, in GiB."""
    lines = ["memory per GPU, GiB (docs/concepts/memory.md):"]
    header = "".join(f"{name:>12}" for name, _ in TERMS)
    for pool in memory_plan(config):
        lines.append(f"  pool {pool.name}: {_verdict(pool)}")
        lines.append(f"    {'role':<8}{header}")
        for role in pool.roles:
            cells = "".join(f"{_cell(getattr(role, attr)):>12}" for _, attr in TERMS)
            lines.append(f"    {role.role:<8}{cells}  {role.note}".rstrip())
        lines += [f"    unknown: {why}" for why in pool.unknown]
    return "\n".join(lines)


def _cell(value: int) -> str:
    return _gib(value) if value else "-"


def _verdict(pool: PoolMemory) -> str:
    need = f"{'at least ' if pool.unknown else ''}{_gib(pool.need_bytes)} needed"
    stays = sum(r.resident_bytes for r in pool.roles)
    how = f"({_gib(stays)} stays, the rest comes and goes)"
    if pool.gpu_bytes is None:
        return f"{need} {how}; GPU memory unknown (gpuMemoryGiB)"
    verdict = "does not fit" if pool.overflows else "fits" if not pool.unknown else "fits so far"
    return f"{need} {how} of {_gib(pool.gpu_bytes)}: {verdict}"
