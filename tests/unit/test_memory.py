"""The memory per GPU of each role (api.memory): the arithmetic of a 70B job on 8 x 80 GiB
GPUs, the admission rule that refuses what cannot fit, and the estimate against what one
actor rank of the tiny model really holds on a CPU (the profiler's allocation events)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlhf_operator.api.validation import InvalidJob, parse_job, parse_spec
from rlhf_operator.app.cli import main
from rlhf_trainer.algo.experience import Experience
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.memory import GIB, PoolMemory, RoleMemory, memory_plan
from rlhf_trainer.api.sections import TinyModel
from tests.specs import local_job

EXAMPLES = Path(__file__).parents[2] / "examples"
# Llama-3.1-70B's config.json: 70.55e9 parameters.
LLAMA_70B = {
    "layers": 80, "hiddenSize": 8192, "intermediateSize": 28672, "kvSize": 1024,
    "vocabSize": 128256,
}  # fmt: skip
LLAMA_70B_PARAMETERS = 70_553_706_496
LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def job_70b(lora: bool, utilization: float, checkpointing: bool) -> dict[str, Any]:
    """GRPO on one node of 8 x 80 GiB, every role colocated; micro-batches of one
    1024-token sample, bf16, engines of TP 8."""
    actor: dict[str, Any] = {"path": "meta-llama/Llama-3.1-70B", "shape": LLAMA_70B}
    if lora:
        actor["lora"] = {"rank": 16, "targetModules": LINEAR_LAYERS}
    spec = {
        "pools": [{"name": "all", "gpusPerNode": 8, "gpuMemoryGiB": 80}],
        "roles": {"actor": "all", "rollout": "all", "ref": "all"},
        "models": {"actor": actor, "reward": {"function": "toy_copy"}},
        "algorithm": {"advantageEstimator": "grpo"},
        "data": {"train": "/data/train.jsonl", "maxPromptLength": 512, "maxResponseLength": 512},
        "generation": {
            "samplesPerPrompt": 8, "tensorParallelSize": 8, "gpuMemoryUtilization": utilization,
        },
        "trainer": {
            "batchSize": 64, "miniBatchSize": 64, "microBatchSize": 1, "precision": "bf16",
            "gradientCheckpointing": checkpointing,
        },
    }  # fmt: skip
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "big"},
            "spec": spec}  # fmt: skip


def role(pool: PoolMemory, name: Role) -> RoleMemory:
    return next(r for r in pool.roles if r.role is name)


def gib(value: int) -> float:
    return value / GIB


def test_the_parameters_of_a_shape_are_the_model_s_own() -> None:
    """70B from Llama's shape; the tiny model's count as transformers builds it, less only
    the q/k/v biases of qwen2 (left out of the estimate: h + 2kv a layer)."""
    from rlhf_trainer.models import build_tiny_model

    shape = JobConfig.model_validate(job_70b(False, 0.35, False)["spec"]).models.actor.shape
    assert shape is not None and shape.parameters(lm_head=True) == LLAMA_70B_PARAMETERS
    tiny = TinyModel(hidden_size=128, num_layers=3, vocab_size=512)
    built = sum(p.numel() for p in build_tiny_model(tiny).parameters())
    biases = tiny.num_layers * 3 * tiny.hidden_size
    assert tiny.shape().parameters(lm_head=True) == built - biases


def test_70b_full_fine_tune_colocated_on_8x80gib_is_refused_naming_the_pool() -> None:
    """FSDP2 over 8 GPUs: fp32 masters, gradients and AdamW's two states are 16 bytes a
    parameter, 16 x 70.55e9 / 8 = 131 GiB a GPU before anything else; and the ref beside
    it, sharded over the same ranks in bf16, 2 x 70.55e9 / 8 = 16.4 GiB. Refused: 218 GiB."""
    manifest = job_70b(lora=False, utilization=0.35, checkpointing=False)
    (pool,) = memory_plan(parse_job(manifest, memory=False).spec)
    actor = role(pool, Role.ACTOR)
    states = actor.weights_bytes + actor.gradients_bytes + actor.optimizer_bytes
    assert gib(states) == pytest.approx(16 * LLAMA_70B_PARAMETERS / 8 / GIB)
    ref = role(pool, Role.REF).weights_bytes
    assert gib(ref) == pytest.approx(2 * LLAMA_70B_PARAMETERS / 8 / GIB, abs=1e-6)
    with pytest.raises(InvalidJob) as refused:
        parse_job(manifest)
    (error,) = refused.value.errors
    assert error.path == "spec.pools[0]"
    assert error.message.startswith(
        f"pool 'all' cannot fit its roles: they need {gib(pool.need_bytes):.3g} GiB of each "
        "GPU, which has 80 (gpuMemoryGiB): actor: weights 32.9, gradients 32.9, optimizer 65.7"
    )


def test_70b_lora_with_checkpointing_fits_8x80gib_at_a_third_for_vllm() -> None:
    """LoRA (rank 16 on every linear layer, 207e6 parameters) keeps the frozen base as
    FSDP2 shards it: fp32, 4 x 70.55e9 / 8 = 32.9 GiB; the ref is that base (no copy).
    vLLM takes 0.35 x 80 = 28 GiB: weights 2 x 70.55e9 / 8 (TP 8) = 16.4 and 11.6 of KV
    cache. Gradient checkpointing keeps 80 layer inputs of 2 x 8192 bytes a token; with
    one layer recomputed, the logits (18 bytes x 128256 a token) and FSDP2's gathered
    root and two layers in bf16 (7.1 GiB), activations are 11 GiB: 73.2 of 80. Accepted."""
    manifest = job_70b(lora=True, utilization=0.35, checkpointing=True)
    spec = parse_job(manifest).spec
    (pool,) = memory_plan(spec)
    assert [r.role for r in pool.roles] == [Role.ACTOR, Role.ROLLOUT]
    actor, rollout = role(pool, Role.ACTOR), role(pool, Role.ROLLOUT)
    assert gib(actor.weights_bytes) == pytest.approx(33.0, abs=0.05)
    assert gib(rollout.weights_bytes + rollout.kv_cache_bytes) == pytest.approx(0.35 * 80)
    assert gib(rollout.weights_bytes) == pytest.approx(2 * LLAMA_70B_PARAMETERS / 8 / GIB)
    assert gib(actor.activation_bytes) == pytest.approx(11.0, abs=0.1)
    assert gib(pool.need_bytes) == pytest.approx(73.2, abs=0.1)
    parse_spec(manifest["spec"])  # the operator admits it too


def test_the_same_lora_job_giving_vllm_half_of_each_gpu_is_refused() -> None:
    """12 GiB more for vLLM (0.5 x 80 = 40): 85.2 GiB, over 80."""
    manifest = job_70b(lora=True, utilization=0.5, checkpointing=True)
    with pytest.raises(InvalidJob, match=r"pool 'all' cannot fit its roles: they need 85.2 GiB"):
        parse_spec(manifest["spec"])


def test_an_engine_share_too_small_for_its_weights_is_refused() -> None:
    """0.15 x 80 = 12 GiB for each engine GPU, under its 16.4 GiB of weights."""
    manifest = job_70b(lora=True, utilization=0.15, checkpointing=True)
    with pytest.raises(InvalidJob) as refused:
        parse_job(manifest)
    paths = [e.path for e in refused.value.errors]
    assert paths == ["spec.generation.gpuMemoryUtilization"]


def test_unknown_sizes_refuse_nothing_and_the_plan_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The same job that cannot fit, without the model's shape, then without the GPU's
    memory: accepted both times; the plan names what is unknown."""
    no_shape = job_70b(lora=False, utilization=0.35, checkpointing=False)
    del no_shape["spec"]["models"]["actor"]["shape"]
    no_memory = job_70b(lora=False, utilization=0.35, checkpointing=False)
    del no_memory["spec"]["pools"][0]["gpuMemoryGiB"]
    for manifest in (no_shape, no_memory):
        parse_job(manifest)
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([no_shape, no_memory]))
    assert main(["validate", str(path)]) == 0
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unknown: actor: models.actor has a path and no shape" in out
    assert "GPU memory unknown (gpuMemoryGiB)" in out
    assert "unknown: rollout: its KV cache, as pools[0].gpuMemoryGiB is unset" in out


def test_validate_prints_the_refusal_and_plan_shows_why(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(job_70b(lora=False, utilization=0.35, checkpointing=False)))
    assert main(["validate", str(path)]) == 1
    assert f"{path}: spec.pools[0]: pool 'all' cannot fit its roles" in capsys.readouterr().out
    assert main(["plan", str(path)]) == 0
    assert "  pool all: 218 needed (177 stays, the rest comes and goes) of 80: does not fit" in (
        capsys.readouterr().out
    )


def test_plan_prints_each_role_s_memory_per_gpu_for_the_split_example(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", str(EXAMPLES / "split-8gpu-4-4.yaml")]) == 0
    table = capsys.readouterr().out.split("memory per GPU, GiB")[1].splitlines()
    rows = {line.split()[0] for line in table if line.startswith("    ") and "unknown" not in line}
    assert rows == {"role", "actor", "ref", "rollout", "critic"}
    assert "    unknown: reward: the spec gives no shape for models.reward's model" in table


# --- the estimate against one actor rank of the tiny model, measured on a CPU ---------

ROWS, LENGTH = 4, 64  # a micro-batch: 4 samples of 32 prompt and 32 response tokens
TINY = {"hiddenSize": 256, "numLayers": 2, "vocabSize": 2048}
MEASURED_WITHIN = 0.15


def tiny_job(
    precision: str, tiny: dict[str, int] = TINY, rows: int = ROWS, length: int = LENGTH
) -> JobConfig:
    """The local example's actor alone on its one-rank pool (no ref), one micro-batch a
    mini-batch of `rows` samples of `length` tokens."""
    spec = local_job(colocated=True, total_steps=1, checkpoint_dir=Path("/unused"), every_steps=1)
    config = spec.model_dump(by_alias=True, exclude_none=True)
    config["models"]["actor"]["tiny"] |= tiny
    config["roles"].pop("ref")
    config["algorithm"]["klCoef"] = 0.0
    config["data"] |= {"maxPromptLength": length // 2, "maxResponseLength": length - length // 2}
    config["trainer"] |= {"precision": precision, "batchSize": rows, "miniBatchSize": rows,
                          "microBatchSize": rows}  # fmt: skip
    return JobConfig.model_validate(config)


def experience(rows: int, length: int, vocabulary: int) -> Experience:
    """Random sequences whose second half is the response; even rows rewarded."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocabulary, (rows, length), generator=generator)
    response = torch.zeros(rows, length)
    response[:, length // 2 :] = 1.0
    sign = torch.tensor([1.0 if row % 2 == 0 else -1.0 for row in range(rows)])
    zeros = torch.zeros(rows, length)
    return Experience(
        input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=response,
        rollout_log_probs=zeros, policy_version=torch.zeros(rows, dtype=torch.long),
        old_log_probs=zeros, values=zeros, advantages=sign[:, None] * response, returns=zeros,
    )  # fmt: skip


@dataclass(frozen=True)
class Held:
    states_bytes: int  # parameters, gradients and optimizer state after a real step
    activation_bytes: int  # the peak over a forward/backward, above what was held before


def unique_bytes(tensors: Any) -> int:
    """Bytes of the storages behind `tensors` (a DTensor's: its local shard), each once."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def peak_allocated_bytes(run: Any) -> int:
    """The most bytes the CPU allocator held at once while `run()` ran, above what it held
    before: every allocation and free, replayed in order (torch.profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    events = profiler.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak


def measure_one_actor_rank(rank: int, precision: str) -> Held:
    """One actor rank (FSDP2 over gloo, world size 1) after a real update, then a forward
    and backward of the actor's loss over one micro-batch."""
    from rlhf_trainer.roles.policy import Actor
    from rlhf_trainer.worker import RankInfo

    actor = Actor(RankInfo(Role.ACTOR, "policy", rank, 1), tiny_job(precision))
    batch = experience(ROWS, LENGTH, TINY["vocabSize"])
    actor.update(batch, step=1)
    parameters = list(actor.model.parameters())
    optimizer = [v for s in actor.optimizer.state.values() for v in s.values() if v.dim() > 0]
    held = unique_bytes([*parameters, *(p.grad for p in parameters), *optimizer])
    normalizer = batch.response_mask.sum()
    actor.model.train()

    def forward_backward() -> None:  # gradients already held, as from the step before
        loss, _ = actor.loss(batch, normalizer)
        loss.backward()  # type: ignore[no-untyped-call]

    return Held(held, peak_allocated_bytes(forward_backward))


def measure_both(rank: int) -> dict[str, Held]:
    return {precision: measure_one_actor_rank(rank, precision) for precision in PRECISIONS}


PRECISIONS = ("fp32", "bf16")


def test_the_estimate_matches_what_one_actor_rank_of_the_tiny_model_holds() -> None:
    """Measured (2.62e6 parameters): the states 16 bytes a parameter, to 0.1% (the
    estimate leaves out qwen2's biases); activations 25.6 MB in fp32 (estimate 24.9) and
    18.3 in bf16 (18.35): 2 layers x 256 tokens of 8h + c(6h + 2kv + 4i), the logits' 16
    (18) bytes x 2048 a token, the tied head's gradient."""
    from tests.trainer.distributed import run_ranks

    (measured,) = run_ranks(measure_both, 1)  # one process: its imports paid once
    for precision, held in measured.items():
        (pool,) = memory_plan(tiny_job(precision))
        actor = role(pool, Role.ACTOR)
        states = actor.weights_bytes + actor.gradients_bytes + actor.optimizer_bytes
        print(f"{precision}: states {held.states_bytes} measured, {states} estimated; "
              f"activations {held.activation_bytes} measured, {actor.activation_bytes} "
              "estimated")  # fmt: skip
        assert states == pytest.approx(held.states_bytes, rel=MEASURED_WITHIN), precision
        assert actor.activation_bytes == pytest.approx(
            held.activation_bytes, rel=MEASURED_WITHIN
        ), precision
