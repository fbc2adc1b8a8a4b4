"""A local run's folder, charts and summary: what each step leaves behind, and how."""

from __future__ import annotations

import io
import json
import math
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from rlhf_trainer.algo.diagnostics import CriticStats, ResponseStats
from rlhf_trainer.api.progress import EvalProgress, OutputProgress
from rlhf_trainer.loop.interrupt import stop_on_interrupt
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.charts import (
    DPI,
    SIZE_INCHES,
    pool_busy_figure,
    reward_kl_figure,
    write_charts,
)
from rlhf_trainer.telemetry.progress import (
    LiveProgress,
    Summary,
    eval_text,
    model_row,
    step_text,
)
from rlhf_trainer.telemetry.run_folder import RunFolder, RunFolderError, StepRecord
from tests.unit.test_trainer_metrics import ACTOR  # the same actor stats in both

CRITIC = CriticStats(
    value_loss=0.5, value_clip_fraction=0.0, grad_norm=0.75, explained_variance=0.5
)
RESPONSES = ResponseStats(length_mean=12.5, length_max=16, truncated_ratio=0.25)


def step_result(step: int, reward: float = 0.5, critic: CriticStats | None = CRITIC) -> StepResult:
    return StepResult(
        step=step,
        seconds=0.5,
        reward_mean=reward,
        kl=0.001 * step,
        kl_coef=0.05,
        response_tokens=400,
        rollout_log_prob_diff=0.0,
        actor=ACTOR,
        critic=critic,
        responses=RESPONSES,
    )


def record(step: int, reward: float = 0.5, busy: float = 0.5) -> StepRecord:
    return StepRecord.of(step_result(step, reward), 32, {"policy": busy, "value": busy / 2})


def evaluation(step: int, reward: float = 0.5) -> EvalProgress:
    return EvalProgress(
        step=step,
        policy_version=step,
        prompts=64,
        samples_per_prompt=1,
        reward_mean=reward,
        pass_at_1=reward / 2,
        response_length_mean=4.0,
    )


def test_a_step_record_has_the_step_its_speed_and_each_pools_busy_share() -> None:
    line = json.loads(record(3, reward=0.25, busy=0.5).to_json())
    assert line["step"] == 3
    assert line["reward_mean"] == 0.25
    assert line["kl"] == 0.003
    assert line["kl_coef"] == 0.05
    assert line["samples_per_second"] == 64.0  # 32 samples in 0.5 s
    assert line["seconds"] == 0.5
    assert line["pool_busy"] == {"policy": 0.5, "value": 0.25}
    assert line["actor"]["grad_norm"] == 1.5
    assert line["critic"]["value_loss"] == 0.5
    assert line["responses"]["truncated_ratio"] == 0.25


def test_nan_is_written_as_null_and_read_back_as_nan() -> None:
    flat = replace(CRITIC, explained_variance=math.nan)  # flat returns
    step = StepRecord.of(step_result(1, critic=flat), 32, {})
    text = step.to_json()
    assert json.loads(text)["critic"]["explained_variance"] is None  # strict JSON
    back = StepRecord.from_json(text)
    assert back.critic is not None and math.isnan(back.critic.explained_variance)
    assert replace(back, critic=CRITIC) == replace(step, critic=CRITIC)


def test_a_step_with_no_reward_is_written_as_null_and_read_back_as_nan() -> None:
    """Every sample unscored (a reward service down for the step): no mean reward."""
    step = StepRecord.of(step_result(2, reward=math.nan), 32, {})
    assert json.loads(step.to_json())["reward_mean"] is None
    back = StepRecord.from_json(step.to_json())
    assert math.isnan(back.reward_mean)
    assert replace(back, reward_mean=0.0) == replace(step, reward_mean=0.0)


def test_a_critic_free_step_has_no_critic() -> None:
    step = StepRecord.of(step_result(1, critic=None), 32, {"policy": 0.5})
    assert json.loads(step.to_json())["critic"] is None
    assert StepRecord.from_json(step.to_json()) == step


def test_the_folder_keeps_one_line_per_step_across_a_resume(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    folder.create()
    for step in (1, 2, 3, 4):
        folder.append(record(step))
    folder.forget_after(2)  # resumed from the checkpoint of step 2
    for step in (3, 4, 5):
        folder.append(record(step, reward=0.75))
    assert [r.step for r in folder.records()] == [1, 2, 3, 4, 5]
    assert [r.reward_mean for r in folder.records()] == [0.5, 0.5, 0.75, 0.75, 0.75]
    assert len(folder.metrics.read_text().splitlines()) == 5


def test_the_folder_keeps_one_line_per_evaluation_across_a_resume(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    folder.create()
    for step in (0, 2, 4):
        folder.append_eval(evaluation(step))
    folder.forget_after(2)  # resumed from the checkpoint of step 2: evaluated again at 4
    folder.append_eval(evaluation(4, reward=0.75))
    assert folder.evaluations() == [evaluation(0), evaluation(2), evaluation(4, reward=0.75)]
    assert json.loads(folder.evals.read_text().splitlines()[0])["passAt1"] == 0.25


def test_an_unwritable_run_folder_names_the_path_and_the_os_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(RunFolderError, match=r"a-file/run: cannot write to it: Not a directory"):
        RunFolder(blocker / "run").create()


def test_the_reward_chart_draws_reward_and_kl_over_the_steps() -> None:
    records = [record(step, reward=0.1 * step) for step in (1, 2, 3)]
    figure = reward_kl_figure(records)
    lines = [line for axes in figure.axes for line in axes.get_lines()]
    assert {line.get_label(): list(line.get_xdata()) for line in lines} == {
        "reward": [1, 2, 3],
        "KL": [1, 2, 3],
    }
    reward = next(line for line in lines if line.get_label() == "reward")
    assert list(reward.get_ydata()) == pytest.approx([0.1, 0.2, 0.3])


def test_the_reward_chart_draws_the_held_out_reward_beside_the_training_reward() -> None:
    records = [record(step) for step in (1, 2, 3)]
    figure = reward_kl_figure(records, [evaluation(0, 0.125), evaluation(3, 0.625)])
    (reward_axes, _) = figure.axes
    lines = {line.get_label(): line for line in reward_axes.get_lines()}
    assert list(lines["held-out reward"].get_xdata()) == [0, 3]
    assert list(lines["held-out reward"].get_ydata()) == [0.125, 0.625]


def test_the_busy_chart_draws_one_line_per_pool_in_percent() -> None:
    figure = pool_busy_figure([record(1, busy=0.25), record(2, busy=0.5)])
    lines = {line.get_label(): list(line.get_ydata()) for line in figure.axes[0].get_lines()}
    assert lines == {"policy": [25.0, 50.0], "value": [12.5, 25.0]}


def test_the_charts_are_pngs_of_the_expected_size(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    folder.append(record(1))
    folder.append(record(2))
    write_charts(folder)
    for chart in (folder.reward_chart, folder.busy_chart):
        with Image.open(chart) as image:
            assert image.format == "PNG"
            assert image.size == (SIZE_INCHES[0] * DPI, SIZE_INCHES[1] * DPI)
            image.verify()
    charts = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".png")
    assert charts == ["pool_busy.png", "reward_kl.png"]


def test_charts_of_no_steps_yet_are_still_images(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    write_charts(folder)  # interrupted before the first step
    with Image.open(folder.busy_chart) as image:
        assert image.format == "PNG"


def test_the_bar_shows_reward_kl_speed_and_busy_shares() -> None:
    assert step_text(record(2, reward=0.25, busy=0.5)) == (
        "reward 0.250 · KL 0.0020 · 64.0 samples/s · busy policy 50% value 25%"
    )


def test_the_summary_compares_the_first_and_last_steps(tmp_path: Path) -> None:
    records = [record(1, reward=0.125), record(2, reward=0.5, busy=0.75)]
    rows = dict(Summary(records, 10, 42.0, tmp_path, "ckpt/step-2").rows())
    assert rows["steps"] == "2/10"
    assert rows["wall time"] == "42 s"
    assert rows["reward"] == "0.125 at step 1 → 0.500 at step 2"
    assert rows["pool policy busy"] == "75%"
    assert rows["run folder"] == str(tmp_path)
    assert rows["last checkpoint"] == "ckpt/step-2"
    assert "held-out reward" not in rows  # no data.eval
    assert "rollout engines" not in rows  # synchronous: none counted


def test_the_summary_says_what_the_model_written_is() -> None:
    merged = OutputProgress(path="runs/a/model", step=4, dtype="bf16")
    assert model_row(merged) == "runs/a/model (Hugging Face, bf16, step 4)"
    adapter = merged.model_copy(update={"adapter": True})
    assert model_row(adapter) == "runs/a/model (LoRA adapter, peft's format, bf16, step 4)"
    assert model_row(None).startswith("not written: the run stopped before its end")


def test_the_summary_marks_where_the_rollout_engines_changed(tmp_path: Path) -> None:
    engines = [2, 2, 1, 1, 2]  # one lost after step 2, one joined after step 4
    records = [replace(record(i + 1), rollout_engines=n) for i, n in enumerate(engines)]
    rows = dict(Summary(records, 5, 1.0, tmp_path, None).rows())
    assert rows["rollout engines"] == "2 from step 1, 1 from step 3, 2 from step 5"
    steady = [replace(r, rollout_engines=2) for r in records]
    assert "rollout engines" not in dict(Summary(steady, 5, 1.0, tmp_path, None).rows())


def test_the_summary_compares_the_first_and_last_evaluations(tmp_path: Path) -> None:
    evaluations = [evaluation(0, reward=0.125), evaluation(20, reward=0.5)]
    rows = dict(Summary([record(1)], 20, 1.0, tmp_path, None, evaluations).rows())
    assert rows["held-out reward"] == "0.125 at step 0 → 0.500 at step 20"
    assert rows["held-out pass@1"] == "0.06 → 0.25"
    sampled = [
        e.model_copy(update={"pass_at_k": 0.5, "samples_per_prompt": 4}) for e in evaluations
    ]
    rows = dict(Summary([record(1)], 20, 1.0, tmp_path, None, sampled).rows())
    assert rows["held-out pass@4"] == "0.50 → 0.50"
    assert "held-out tool-call rate" not in rows  # single-turn: no episodes
    rates = (0.0, 0.75)
    played = [
        e.model_copy(update={"tool_call_rate": r}) for e, r in zip(evaluations, rates, strict=True)
    ]
    rows = dict(Summary([record(1)], 20, 1.0, tmp_path, None, played).rows())
    assert rows["held-out tool-call rate"] == "0.00 → 0.75"
    assert eval_text(played[1]).endswith("(pass@1 0.25, tool calls in 75% of episodes)")


def test_ctrl_c_asks_to_stop_and_a_second_one_quits(default_sigint: None) -> None:
    with stop_on_interrupt() as stop:
        assert not stop()
        signal.raise_signal(signal.SIGINT)
        assert stop()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_off_a_terminal_there_is_no_bar_and_no_control_characters(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out)  # a pipe, a CI log
    with LiveProgress(console, 10) as progress:
        progress.update(record(1))
    console.print(Summary([record(1)], 10, 1.0, tmp_path, None).table())
    text = out.getvalue()
    assert "Run summary" in text
    assert "step" not in text.split("Run summary")[0]  # no bar before the table
    assert not any(ord(c) < 32 and c != "\n" for c in text), repr(text)


def test_a_local_run_serves_the_environments_named_by_class_while_it_runs() -> None:
    import asyncio

    import psutil  # type: ignore[import-untyped]
    import yaml

    from rlhf_env.client import EnvironmentClient
    from rlhf_trainer.api.agentic import EnvironmentConfig
    from rlhf_trainer.api.config import JobConfig
    from rlhf_trainer.cluster.local import local_environments
    from rlhf_trainer.rollout.episodes import EnvironmentUnreachable, check_environment
    from tests.specs import LOCAL_EXAMPLE

    spec = yaml.safe_load(LOCAL_EXAMPLE.read_text())["spec"]
    spec["environments"] = [
        {"name": "lookup", "serve": "rlhf_env.toys:LetterLookup"},
        {"name": "remote", "url": "http://tools.team.svc:8000"},
    ]
    config = JobConfig.model_validate(spec)
    with pytest.raises(EnvironmentUnreachable, match="'lookup' has no url: an environment given"):
        check_environment(config.environment("lookup"))  # what a cluster driver would say

    with local_environments(config) as served:
        lookup, remote = served.environments
        assert remote == config.environments[1]
        assert lookup.serve is None and lookup.url is not None
        check_environment(lookup)  # it answers

        async def health() -> str:
            async with EnvironmentClient(str(lookup.url)) as client:
                return (await client.health()).environment

        assert asyncio.run(health()) == "LetterLookup"
    with pytest.raises(EnvironmentUnreachable, match="'lookup' did not answer within 3 s: "):
        check_environment(EnvironmentConfig(name="lookup", url=lookup.url), wait_seconds=3)

    # With episodes, the server's deadlines are theirs, as the operator gives its pods.
    spec["generation"]["multiTurn"] = {
        "environment": "lookup", "toolCallTimeoutSeconds": 7, "episodeTimeoutSeconds": 90,
    }  # fmt: skip
    spec["models"]["reward"] = {"environment": True}
    with local_environments(JobConfig.model_validate(spec)):
        (server,) = [
            " ".join(child.cmdline())
            for child in psutil.Process().children()
            if "rlhf_env.toys:LetterLookup" in child.cmdline()
        ]
    assert "--call-seconds 7.0 --idle-seconds 90.0" in server
