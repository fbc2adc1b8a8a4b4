"""generation.multiTurn's chat-template fields (issue 72): validated with their field's
path, and handed to the episodes' renderer and limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.rollout.episodes import EpisodeLimits
from tests.unit.celcheck import assert_refused, cel_errors

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"
FIELD = "spec.generation.multiTurn"


@pytest.fixture
def job() -> dict[str, Any]:
    """The agentic example, its environment at a url (as a cluster runs it)."""
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["environments"] = [{"name": "lookup", "url": "http://127.0.0.1:9"}]
    return manifest


def multi_turn(job: dict[str, Any]) -> dict[str, Any]:
    section: dict[str, Any] = job["spec"]["generation"]["multiTurn"]
    return section


TEMPLATE = "{% for m in messages %}{{ m.content }}{{ eos_token }} {% endfor %}"


def test_the_chat_template_fields_pass_both_validators_and_reach_the_episodes(
    job: dict[str, Any],
) -> None:
    from rlhf_trainer.rollout.worker import episode_runner

    kwargs = {"enable_thinking": False, "date_string": "26 Jul 2024", "depth": 2}
    multi_turn(job).update(
        chatTemplate=TEMPLATE, chatTemplateKwargs=kwargs, maxObservationTokens=256
    )
    assert cel_errors(job) == []
    config = parse_job(job).spec.job_config()
    assert config.multi_turn is not None
    assert config.multi_turn.chat_template_kwargs == kwargs
    assert EpisodeLimits.of(config).observation_tokens == 256
    runner = episode_runner(config)
    assert runner is not None
    assert runner.renderer.template == TEMPLATE
    assert runner.renderer.observation_text([]) == " "  # its glue after </s>, no prompt
    assert runner.renderer.end_of_turn == "</s>"


def test_unset_they_change_nothing(job: dict[str, Any]) -> None:
    config = parse_job(job).spec.job_config()
    assert config.multi_turn is not None
    assert config.multi_turn.chat_template is None
    assert config.multi_turn.chat_template_kwargs == {}
    assert EpisodeLimits.of(config).observation_tokens is None


@pytest.mark.parametrize(
    ("fields", "path", "words"),
    [
        ({"chatTemplateKwargs": {"tools": "x"}}, "chatTemplateKwargs",
         "tools: set by the trainer, not a template argument"),
        ({"chatTemplateKwargs": {"add_generation_prompt": False, "strftime_now": "x"}},
         "chatTemplateKwargs", "add_generation_prompt, strftime_now: set by the trainer"),
        ({"chatTemplateKwargs": {"nested": {"a": 1}}}, "chatTemplateKwargs.nested",
         "valid boolean"),
        ({"chatTemplate": ""}, "chatTemplate", "at least 1 character"),
        ({"maxObservationTokens": 0}, "maxObservationTokens", "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_bad_chat_template_fields_are_refused_naming_the_field(
    job: dict[str, Any], fields: dict[str, Any], path: str, words: str
) -> None:
    multi_turn(job).update(fields)
    assert_refused(job, f"{FIELD}.{path}", words, cel_too=False)
