"""Multi-turn episodes on real vLLM (the CPU build) against real environment servers.

One tiny-model engine for the module, one uvicorn server in a thread with every test
environment. The token test is the contract the trainer lives by: what it trains on is
exactly what the engine sampled, in the context the engine sampled it in, and the
environment's tokens between turns are attended to but never trained on. The limit
and fault tests break an episode in each way the issue names (a limit, an environment
that hangs, one that fails), and check that it is cut, masked, scored 0, named, and
that its session is closed.

The tiny model's word-level tokenizer cannot drift when re-tokenised; the drift cases
("look" + "up", "gr" + "een") are tests/unit/test_trajectory.py's, on SmolLM2's
tokenizer, through the same EpisodeRunner.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_env.client import EnvironmentClient
from rlhf_env.protocol import Message, Step
from rlhf_env.replicas import EnvironmentReplicas
from rlhf_env.server import app_for
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.cuts import TRAINED_BY_DEFAULT
from rlhf_trainer.api.sections import ModelSource, TinyModel
from rlhf_trainer.models import chat_tokenizer, token_log_probs, write_tiny_model
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.rollout.episodes import EpisodeLimits, EpisodeRunner
from rlhf_trainer.rollout.trajectory import ChatRenderer
from tests.environments import CHATTER_REPLY, CHATTER_TURNS, Chatter, served

pytestmark = pytest.mark.slow  # one vLLM engine for the module (~30 s to start)

TINY = TinyModel(architecture="qwen2", hidden_size=128, num_layers=2, num_heads=4, vocab_size=64)
LOG_PROB_TOLERANCE = 1e-3  # fp32 on both sides, as in test_rollout_vllm
TURNS = CHATTER_TURNS
TURN_TOKENS = 4
LIMITS = EpisodeLimits(
    max_turns=TURNS, max_tokens=64, turn_tokens=TURN_TOKENS, call_seconds=10,
    turn_seconds=60, episode_seconds=120,
)  # fmt: skip


class Hangs(Chatter):
    async def step(self, message: Message) -> Step:
        await asyncio.sleep(30)
        return await super().step(message)


class Fails(Chatter):
    async def step(self, message: Message) -> Step:
        if self.turns == 1:
            raise RuntimeError("the tool broke")
        return await super().step(message)


ENVIRONMENTS = {"chatter": Chatter, "hangs": Hangs, "fails": Fails}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(TINY, tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[RolloutEngine]:
    engine = RolloutEngine(model_dir, max_model_len=LIMITS.max_tokens, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with served({name: app_for(kind) for name, kind in ENVIRONMENTS.items()}) as url:
        yield url


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(chat_tokenizer(ModelSource(tiny=TINY)), "tiny")


class Recorded:
    """The engine's turns, as it returned them, per episode."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.turns: dict[int, list[Rollout]] = {}

    def for_episode(self, index: int) -> Any:
        numbers, self.turns[index] = itertools.count(), []

        async def turn(prompt: list[int], max_tokens: int) -> Rollout:
            number = next(numbers)
            sampled = await self.engine.generate(
                f"test-{id(self)}-{index}-{number}", prompt, max_tokens=max_tokens,
                seed=100 * number + index,
            )  # fmt: skip
            self.turns[index].append(sampled)
            return sampled

        return turn


def run_episodes(
    engine: RolloutEngine,
    server: str,
    renderer: ChatRenderer,
    environment: str,
    count: int,
    limits: EpisodeLimits = LIMITS,
) -> tuple[list[Rollout], Recorded, int]:
    """`count` episodes at once; their rollouts, the engine's turns, and the sessions the
    server still holds afterwards."""
    recorded = Recorded(engine)

    async def scenario() -> tuple[list[Rollout], int]:
        replicas = EnvironmentReplicas(f"{server}/{environment}")
        async with EnvironmentClient(f"{server}/{environment}") as client:
            runner = EpisodeRunner(replicas, renderer, "rlhf_toy", limits)
            rollouts = await asyncio.gather(
                *(
                    runner.run({"key": "a"}, recorded.for_episode(i), version=7)
                    for i in range(count)
                )
            )
            await replicas.aclose()
            return list(rollouts), (await client.health()).sessions

    rollouts, sessions = engine.call(scenario())
    return rollouts, recorded, sessions


def test_every_episode_trains_on_exactly_the_tokens_the_engine_sampled(
    engine: RolloutEngine, server: str, renderer: ChatRenderer, model_dir: Path
) -> None:
    rollouts, recorded, sessions = run_episodes(engine, server, renderer, "chatter", 8)
    assert sessions == 0
    observed = renderer.observation_ids([Message(role="user", content=CHATTER_REPLY)], closed=True)
    for index, rollout in enumerate(rollouts):
        turns = recorded.turns[index]
        assert rollout.episode is not None and rollout.episode.cut is None
        assert (rollout.episode.turns, len(turns)) == (TURNS, TURNS)
        assert renderer.tokenizer.decode(rollout.prompt_token_ids) == "<s> a ="
        expected_ids: list[int] = []
        expected_mask: list[int] = []
        expected_log_probs: list[float] = []
        for number, turn in enumerate(turns):
            if number:  # the environment's answer: glue (closing </s> if the turn had none)
                between = renderer.observation_ids(
                    [Message(role="user", content=CHATTER_REPLY)], closed=turns[number - 1].finished
                )
                assert between[-3:] == observed[-3:]  # "b c ="
                expected_ids += between
                expected_mask += [0] * len(between)
                expected_log_probs += [0.0] * len(between)
            expected_ids += turn.response_token_ids
            expected_mask += [1] * len(turn.response_token_ids)
            expected_log_probs += turn.response_log_probs
        assert rollout.response_token_ids == expected_ids
        assert list(rollout.loss_mask) == expected_mask
        assert rollout.response_log_probs == expected_log_probs
        assert rollout.episode.score == sum(
            len(renderer.assistant_text(t.response_token_ids).split()) for t in turns
        )
        assert (rollout.policy_version, rollout.episode.version_span) == (0, 0)
        # What the timeline draws: each environment call and turn, in order, none at once.
        phases = rollout.episode.phases
        assert [(p.kind, p.turn) for p in phases] == [
            ("start", 0),
            *[(kind, turn) for turn in range(1, TURNS + 1) for kind in ("turn", "step")],
            ("score", TURNS),
        ]
        assert all(a.start <= a.end <= b.start for a, b in itertools.pairwise(phases))

    # The trainer's view: transformers on the same weights, over prompt + response, gives
    # the engine's log-prob at every sampled token, in the context of the earlier turns
    # and the environment's messages.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for rollout in rollouts:
        ids = torch.tensor([rollout.prompt_token_ids + rollout.response_token_ids])
        with torch.no_grad():
            log_probs = token_log_probs(model, ids, torch.ones_like(ids))[
                0, len(rollout.prompt_token_ids) :
            ]
        sampled = torch.tensor(rollout.loss_mask, dtype=torch.bool)
        engine_log_probs = torch.tensor(rollout.response_log_probs)
        diff = (log_probs[sampled] - engine_log_probs[sampled]).abs().max()
        assert float(diff) < LOG_PROB_TOLERANCE


# The phase an episode was cut in, where the cut names one.
PHASE_CUT = {"environment_timeout": "step", "environment_error": "step", "turn_timeout": "turn"}


@pytest.mark.parametrize(
    ("environment", "limits", "cut"),
    [
        ("chatter", {"max_turns": 2}, "max_turns"),
        ("chatter", {"max_tokens": 12}, "token_budget"),
        ("hangs", {"call_seconds": 0.5}, "environment_timeout: environment step at "),
        ("fails", {}, "environment_error: environment step at "),
        ("hangs", {"episode_seconds": 1.0}, "episode_timeout"),
        ("chatter", {"turn_seconds": 1e-4}, "turn_timeout"),
    ],
)
def test_an_episode_that_meets_a_limit_or_a_fault_is_cut_as_its_policy_says_and_closed(
    engine: RolloutEngine,
    server: str,
    renderer: ChatRenderer,
    environment: str,
    limits: dict[str, Any],
    cut: str,
) -> None:
    from dataclasses import replace

    rollouts, _, sessions = run_episodes(
        engine, server, renderer, environment, 2, replace(LIMITS, **limits)
    )
    assert sessions == 0  # closed, whatever cut it
    for rollout in rollouts:
        assert rollout.episode is not None
        assert rollout.episode.cut is not None and rollout.episode.cut.startswith(cut)
        assert rollout.episode.score == 0.0 and not rollout.finished
        # The policy's own overruns are trained on (score 0), faults never (multiTurn.cuts)
        trained = cut.split(":")[0] in TRAINED_BY_DEFAULT and rollout.episode.turns > 0
        assert (1 in rollout.loss_mask) == trained, rollout.loss_mask
        assert len(rollout.prompt_token_ids) + len(rollout.response_token_ids) <= LIMITS.max_tokens
        # The timeline shows the phase that was cut, for as long as it ran.
        last = rollout.episode.phases[-1]
        assert last.kind == PHASE_CUT.get(cut.split(":")[0], last.kind), rollout.episode.phases
    if environment == "fails":
        assert "HTTP 500" in (rollouts[0].episode.cut or "")
        assert "the tool broke" in (rollouts[0].episode.cut or "")
