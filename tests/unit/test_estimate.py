"""The placement estimator against step times worked out by hand, its calibration
round trip, the split it suggests, the profiles it loads and `rlhfjob plan --estimate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_operator.app.cli import main
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.estimate import (
    CostProfile,
    bundled_profiles,
    calibrate,
    estimate,
    load_profile,
    rollout_pool_sizes,
    suggest_split,
    sync_gigabytes,
)
from rlhf_trainer.api.lora import LoraConfig
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.api.shape import ModelShape
from tests.specs import job_config

# 240 samples a step (test defaults) of 10 prompt + 30 response tokens: generating them
# on 2 GPUs takes 240 x 30 / (40 x 2) = 90 s, scoring 240 x 40 / (100 x 2) = 48 s,
# training 240 x 40 / (50 x 2) = 96 s, a weight sync 2 GB / 4 GB/s = 0.5 s.
PROFILE = CostProfile(
    source="by hand",
    prompt_tokens=10,
    response_tokens=30,
    generate_tokens_per_second=40,
    forward_tokens_per_second=100,
    train_tokens_per_second=50,
    model_gigabytes=2,
    weight_sync_gigabytes_per_second=4,
    driver_seconds=1,
)
ALL_ON_A = {"actor": "a", "rollout": "a", "ref": "a", "critic": "a", "reward": "a"}
SPLIT = {"actor": "a", "rollout": "a", "ref": "a", "critic": "b", "reward": "b"}
ASYNC = {"actor": "t", "rollout": "r", "critic": "t"}  # a rule-based reward, no ref


def two_gpus(name: str, nodes: int = 1) -> dict[str, object]:
    return {"name": name, "replicas": nodes, "gpusPerNode": 2}


def fully_async(rollout_nodes: int, train_nodes: int) -> object:
    return job_config(
        [two_gpus("r", rollout_nodes), two_gpus("t", train_nodes)],
        ASYNC,
        models={"actor": {"path": "m"}, "reward": {"function": "toy_copy"}},
        algorithm={"klCoef": 0},
        **{"async": {"triggerParameterSyncStep": 2}},
    )


def test_colocated_phases_run_one_after_another() -> None:
    guess = estimate(job_config([two_gpus("a")], ALL_ON_A), PROFILE)
    pool_seconds = 90 + 4 * 48 + 2 * 96 + 0.5  # generate, 4 scorers, 2 updates, sync
    assert guess.step_seconds == pytest.approx(pool_seconds + 1)
    assert guess.samples_per_second == pytest.approx(240 / (pool_seconds + 1))
    assert guess.busy == {"a": pytest.approx(pool_seconds / (pool_seconds + 1))}
    assert guess.phase_seconds[Phase.UPDATE_CRITIC] == pytest.approx(96)


def test_split_lanes_overlap_and_slow_each_other_down() -> None:
    config = job_config([two_gpus("a"), two_gpus("b")], SPLIT)
    slowed = PROFILE.model_copy(update={"concurrent_slowdown": 1.5})
    guess = estimate(config, slowed)
    # generate (alone) + score (a: 2 x 48 || b: 2 x 48) + update (96 || 96) + sync + driver
    assert guess.step_seconds == pytest.approx(90 + 96 * 1.5 + 96 * 1.5 + 0.5 + 1)
    assert guess.phase_seconds[Phase.GENERATE] == pytest.approx(90)  # nothing beside it
    assert guess.phase_seconds[Phase.VALUES] == pytest.approx(48 * 1.5)
    assert guess.busy["b"] == pytest.approx(2 * 96 * 1.5 / guess.step_seconds)


def test_the_rollouts_log_probs_as_pi_old_save_the_actors_scoring_pass() -> None:
    config = fully_async(1, 1)
    rollout = config.model_copy(
        update={"algorithm": config.algorithm.model_copy(update={"old_log_probs": "rollout"})}
    )
    guess = estimate(rollout, PROFILE)
    assert Phase.ACTOR_LOG_PROB not in guess.phase_seconds
    # the fully-async step below less the actor's 48 s of log-probs
    assert guess.step_seconds == pytest.approx(48 + 96 + 96 + 0.5 / 2 + 1)
    assert estimate(config, PROFILE).step_seconds - guess.step_seconds == pytest.approx(48)


def test_fully_async_step_is_the_slower_of_training_and_generation() -> None:
    guess = estimate(fully_async(1, 1), PROFILE)
    # trainer: log-probs and values on one pool (48 + 48), both updates (96 + 96), a
    # sync every 2 steps, the driver; generation (90 s) runs beside it
    trainer = 48 + 48 + 96 + 96 + 0.5 / 2 + 1
    assert guess.step_seconds == pytest.approx(trainer)
    assert guess.busy == {
        "r": pytest.approx(90 / trainer),
        "t": pytest.approx((trainer - 1) / trainer),
    }
    generation_bound = PROFILE.model_copy(update={"generate_tokens_per_second": 10})
    assert estimate(fully_async(1, 1), generation_bound).step_seconds == pytest.approx(360)


def test_a_fully_async_rollout_pool_at_other_sizes_changes_the_step_where_it_bounds_it() -> None:
    generation_bound = PROFILE.model_copy(update={"generate_tokens_per_second": 10})
    sizes = dict(rollout_pool_sizes(fully_async(2, 1), generation_bound))
    assert sorted(sizes) == [1, 3, 4]  # one node less, one more, twice as many
    # generation takes 360 s on one node (2 GPUs), 120 s on 3: there the trainer's
    # 289.25 s bounds the step, and a fourth node gains nothing
    trainer = 48 + 48 + 96 + 96 + 0.5 / 2 + 1
    assert sizes[1].step_seconds == pytest.approx(360)
    assert sizes[3].step_seconds == sizes[4].step_seconds == pytest.approx(trainer)
    assert rollout_pool_sizes(job_config([two_gpus("a")], ALL_ON_A), PROFILE) == []


def test_the_suggested_split_balances_the_pools_on_the_same_gpus() -> None:
    # rollout nodes : train nodes -> step: 1:3 -> max(90, 288/3 + 1.25) = 97.25 s,
    # 2:2 -> max(45, 145.25), 3:1 -> max(30, 289.25)
    suggestion = suggest_split(fully_async(2, 2), PROFILE)
    assert suggestion is not None
    better, guess = suggestion
    assert [p.replicas for p in better.pools] == [1, 3]
    assert guess.step_seconds == pytest.approx(97.25)
    assert suggest_split(job_config([two_gpus("a")], ALL_ON_A), PROFILE) is None


def test_pools_that_share_nodes_get_each_nodes_gpus_shared_out_anew() -> None:
    # Generation (on pool a) is all the work: 240 x 30 / (40 x GPUs of a) s.
    generation_only = PROFILE.model_copy(
        update={"forward_tokens_per_second": 1e12, "train_tokens_per_second": 1e12}
    )
    config = job_config([two_gpus("a"), two_gpus("b")], SPLIT)
    apart = suggest_split(config, generation_only)  # node counts only: 1 and 1
    assert apart is not None and [p.gpus_per_node for p in apart[0].pools] == [2, 2]
    shared = suggest_split(config, generation_only, share_nodes=True)
    assert shared is not None
    better, guess = shared
    assert [(p.replicas, p.gpus_per_node) for p in better.pools] == [(1, 3), (1, 1)]
    assert guess.step_seconds == pytest.approx(240 * 30 / (40 * 3) + 0.5 + 1, rel=1e-6)


def test_a_smaller_critic_costs_its_share_of_the_actors_rate() -> None:
    small_critic = PROFILE.model_copy(update={"role_cost": {"critic": 0.25}})
    guess = estimate(job_config([two_gpus("a")], ALL_ON_A), small_critic)
    assert guess.phase_seconds[Phase.VALUES] == pytest.approx(48 / 4)
    assert guess.phase_seconds[Phase.UPDATE_CRITIC] == pytest.approx(96 / 4)
    assert guess.phase_seconds[Phase.UPDATE_ACTOR] == pytest.approx(96)


def test_a_synchronous_batch_waits_for_its_longest_response() -> None:
    config = job_config([two_gpus("a")], ALL_ON_A)  # maxResponseLength: see tests/specs.py
    longest = config.data.max_response_length
    slow_decode = PROFILE.model_copy(
        update={"decode_tokens_per_second_per_sequence": longest / 200}
    )
    assert estimate(config, slow_decode).phase_seconds[Phase.GENERATE] == pytest.approx(200)
    fast_decode = PROFILE.model_copy(update={"decode_tokens_per_second_per_sequence": 1e9})
    assert estimate(config, fast_decode).phase_seconds[Phase.GENERATE] == pytest.approx(90)
    # streaming generation (fully async) is bound by throughput only
    streaming = estimate(fully_async(1, 1), slow_decode).phase_seconds[Phase.GENERATE]
    assert streaming == pytest.approx(90)


def test_calibrating_on_a_run_recovers_the_rates_it_ran_at() -> None:
    config = job_config([two_gpus("a")], ALL_ON_A)
    measured = estimate(config, PROFILE).phase_seconds
    unknown = PROFILE.model_copy(
        update={"generate_tokens_per_second": 1.0, "train_tokens_per_second": 7.0}
    )
    assert calibrate(config, measured, 1.0, like=unknown) == PROFILE
    with pytest.raises(ValueError, match="no work or no time measured for generate"):
        calibrate(config, {**measured, Phase.GENERATE: 0.0}, 1.0, like=unknown)


def test_profiles_load_by_name_or_file_and_name_a_bad_field(tmp_path: Path) -> None:
    assert {"cpu-2core", "h20-qwen2.5-math-7b"} <= set(bundled_profiles())
    for name in bundled_profiles():
        assert load_profile(name).generate_tokens_per_second > 0
    with pytest.raises(
        ValueError, match=r"profile 'nope': no such file or bundled profile \(cpu-2core"
    ):
        load_profile("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        PROFILE.model_dump_json(by_alias=True).replace(
            '"generateTokensPerSecond":40.0', '"generateTokensPerSecond":0'
        )
    )
    with pytest.raises(ValueError, match="generateTokensPerSecond: Input should be greater than 0"):
        load_profile(str(bad))


def test_plan_estimate_prints_the_step_the_pools_and_a_split(
    capsys: pytest.CaptureFixture[str],
) -> None:
    jobs = Path(__file__).parents[2] / "bench" / "estimate" / "verl-7b.yaml"
    assert main(["plan", str(jobs), "--estimate", "--profile", "h20-qwen2.5-math-7b"]) == 0
    out = capsys.readouterr().out
    assert "estimate (rates: verl's colocated Qwen2.5-Math-7B DAPO run on 64 H20s" in out
    assert "  step 365 s, 22.4 samples/s" in out  # the run the rates came from, reproduced
    assert "  pool rollout: busy 70% (generate 151 s)" in out
    assert "  balanced split: rollout 8 x 8 GPUs, train 8 x 8 GPUs" in out
    assert main(["plan", str(jobs), "--estimate", "--profile", "nope"]) == 1
    assert "profile 'nope': no such file" in capsys.readouterr().err


QWEN_7B = ModelShape(
    layers=28, hidden_size=3584, intermediate_size=18944, kv_size=512, vocab_size=152064
)


def lora_job(target_modules: list[str], **models: object) -> JobConfig:
    lora = {"rank": 16, "targetModules": target_modules}
    return job_config(
        [two_gpus("a")],
        ALL_ON_A,
        models={"actor": {"path": "m", "lora": lora}, "reward": {"path": "rm"}, **models},
        trainer={"batchSize": 240, "miniBatchSize": 120, "precision": "bf16"},
    )


def peft_adapter_parameters(tiny: TinyModel, targets: list[str]) -> int:
    """The trainable parameters of peft's own rank-8 adapter on the tiny model."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    from rlhf_trainer.models import build_tiny_model

    peft = get_peft_model(build_tiny_model(tiny), PeftLora(r=8, target_modules=targets))
    return sum(p.numel() for p in peft.parameters() if p.requires_grad)


def test_a_lora_adapter_is_sized_as_peft_builds_it() -> None:
    """The count from the linear shapes against peft's own adapter on the tiny model."""
    tiny = TinyModel(hidden_size=64, num_layers=3, num_heads=2, vocab_size=64)
    shape = tiny.shape()  # layers=3, hidden_size=64, intermediate_size=4 * 64, kv_size=64
    for targets in (["q_proj", "v_proj"], list(shape.linear_shapes())):
        lora = LoraConfig(rank=8, target_modules=targets)
        assert shape.adapter_parameters(lora) == peft_adapter_parameters(tiny, targets), targets
    # A tiny job's adapter is sized from the tiny model's own layers, as it is built.
    tiny_job = job_config(
        [two_gpus("a")],
        ALL_ON_A,
        models={
            "actor": {"tiny": tiny.model_dump(by_alias=True), "lora": {"rank": 8}},
            "reward": {"path": "rm"},
        },
    )
    trainable = peft_adapter_parameters(tiny, LoraConfig().target_modules)
    assert sync_gigabytes(tiny_job, PROFILE) == pytest.approx(trainable * 4 / 1e9)  # fp32
    with pytest.raises(ValueError, match=r"lora.targetModules \['c_attn'\]: the estimate sizes"):
        shape.adapter_parameters(LoraConfig(target_modules=["q_proj", "c_attn"]))


def test_a_lora_job_syncs_its_adapter_and_updates_for_less() -> None:
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    profile = PROFILE.model_copy(update={"model_shape": QWEN_7B, "lora_train_cost": 0.5})
    full = estimate(job_config([two_gpus("a")], ALL_ON_A), profile)
    guess = estimate(lora_job(attention), profile)
    # 28 layers x rank 16 x (q 3584+3584, k and v 3584+512 each, o 3584+3584), in bf16
    adapter_gigabytes = 28 * 16 * (2 * 7168 + 2 * 4096) * 2 / 1e9
    assert guess.phase_seconds[Phase.SYNC_WEIGHTS] == pytest.approx(adapter_gigabytes / 4)
    assert guess.phase_seconds[Phase.UPDATE_ACTOR] == pytest.approx(96 * 0.5)
    assert guess.phase_seconds[Phase.UPDATE_CRITIC] == pytest.approx(96)  # not LoRA'd
    assert full.phase_seconds[Phase.UPDATE_ACTOR] == pytest.approx(96)
    critic = {"path": "m", "lora": {"rank": 8, "targetModules": attention}}
    both = estimate(lora_job(attention, critic=critic), profile)
    assert both.phase_seconds[Phase.UPDATE_CRITIC] == pytest.approx(96 * 0.5)
    with pytest.raises(ValueError, match="set modelShape"):
        estimate(lora_job(attention), PROFILE)  # no shape to size the adapter


def test_plan_estimate_prices_the_lora_example(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).parents[2] / "examples" / "lora-grpo.yaml"
    assert main(["plan", str(example), "--estimate", "--profile", "h20-qwen2.5-math-7b"]) == 0
    # rank 32 on all seven linear layers of Qwen2.5-7B: 80.7M parameters, in bf16
    assert (
        "  LoRA rank 32: a sync moves the adapter, 161 MB (the model: 1.52e+04 MB); updates at 0.67"
        in (capsys.readouterr().out)
    )
    assert main(["plan", str(example), "--estimate", "--profile", "cpu-2core"]) == 1
    assert "set modelShape" in capsys.readouterr().err
