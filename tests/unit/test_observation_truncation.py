"""multiTurn.observationTruncation (issue 72): which part of an environment message over
multiTurn.maxObservationTokens is cut: its tail (the first tokens kept, the default),
its head (the last kept) or its middle (half from each end), at a marker that says how
many tokens were cut. On SmolLM2's real tokenizer and chat template, and through a whole
episode (EpisodeRunner, the real protocol server, a scripted engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_env.protocol import Message
from rlhf_operator.api.validation import parse_job
from rlhf_trainer.api.agentic import ObservationTruncation
from rlhf_trainer.rollout.chat_template import ChatRenderer
from rlhf_trainer.rollout.episodes import EpisodeLimits
from tests.chat_families import HERMES_CALL
from tests.conftest import needs
from tests.real_model import real_model_dir
from tests.unit.celcheck import assert_refused
from tests.unit.test_episode_cuts import play

pytestmark = needs(
    None
    if (real_model_dir() / "tokenizer.json").exists()
    else f"no SmolLM2 tokenizer at {real_model_dir()} (make real-model)"
)

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"
RESULT = " ".join(f"line {i}," for i in range(200))  # each end told apart by its numbers
KEPT = 16


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    from transformers import AutoTokenizer

    return ChatRenderer(AutoTokenizer.from_pretrained(real_model_dir()), "SmolLM2")


def cut(renderer: ChatRenderer, side: ObservationTruncation, text: str = RESULT) -> str:
    (message,) = renderer.bounded(
        [Message(role="tool", tool_call_id="call00000", content=text)], KEPT, side
    )
    assert message.content is not None
    return message.content


def test_each_side_keeps_max_observation_tokens_of_the_rest_at_a_marker(
    renderer: ChatRenderer,
) -> None:
    tokenizer = renderer.tokenizer
    ids = tokenizer.encode(RESULT, add_special_tokens=False)
    first, last = (tokenizer.decode(part) for part in (ids[:KEPT], ids[-KEPT:]))
    half, other_half = tokenizer.decode(ids[: KEPT // 2]), tokenizer.decode(ids[-KEPT // 2 :])
    marker = f"[... {len(ids) - KEPT} of {len(ids)} tokens cut]"
    assert cut(renderer, "tail") == f"{first}\n{marker}"
    assert cut(renderer, "head") == f"{marker}\n{last}"
    assert cut(renderer, "middle") == f"{half}\n{marker}\n{other_half}"
    assert cut(renderer, "tail").startswith("line 0, line 1,")
    assert cut(renderer, "head").endswith("line 198, line 199,")
    assert cut(renderer, "middle").startswith("line 0,")
    assert cut(renderer, "middle").endswith("line 199,")
    for side in ("tail", "head", "middle"):  # a message within the bound is whole
        assert cut(renderer, side, "line 0, line 1") == "line 0, line 1"


def test_a_whole_episode_keeps_the_side_its_spec_says(renderer: ChatRenderer) -> None:
    def episode(side: ObservationTruncation) -> str:
        limits = EpisodeLimits(max_turns=4, max_tokens=4096, turn_tokens=64, call_seconds=10,
                               turn_seconds=10, episode_seconds=30, observation_tokens=KEPT,
                               observation_truncation=side)  # fmt: skip
        rollout = play(renderer, "hermes", HERMES_CALL, {"content": RESULT}, limits)
        assert rollout.episode is not None
        assert (rollout.episode.cut, rollout.episode.score) == (None, 1.0)
        return str(renderer.tokenizer.decode(rollout.response_token_ids))

    for side in ("tail", "head", "middle"):
        assert cut(renderer, side) in episode(side), side  # as the renderer bounds it
    assert "line 199," not in episode("tail") and "line 0," not in episode("head")


def job(**multi_turn: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["environments"] = [{"name": "lookup", "url": "http://127.0.0.1:9"}]
    manifest["spec"]["generation"]["multiTurn"].update(multi_turn)
    return manifest


def test_the_side_reaches_the_episodes_and_a_bad_one_is_refused() -> None:
    config = parse_job(job(observationTruncation="middle")).spec.job_config()
    assert EpisodeLimits.of(config).observation_truncation == "middle"
    assert EpisodeLimits.of(parse_job(job()).spec.job_config()).observation_truncation == "tail"
    field = "spec.generation.multiTurn.observationTruncation"
    assert_refused(job(observationTruncation="start"), field, "'tail', 'head' or 'middle'", False)
