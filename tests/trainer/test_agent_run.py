"""A whole job of agent episodes (generation.agent): the tiny model behind each rollout
engine's gateway, a real agent served as a local run serves one (`python -m rlhf_env
agent`, this module's `run`, written only against the `openai` client), real Ray and vLLM.

Each episode makes two calls and answers with a reward of its own (1 + the length of its
last reply: never 0). In an odd episode the second call appends to the first's
conversation (one sample; or two, where the template renders the first reply, cut at
maxCallTokens, as other tokens than were sampled); in an even one it replaces the
history with a summary, so it extends nothing and the episode has two samples (the count
of episodes picks which: an event, not a timer). Every sample is trained on. The third episode the agent is sent fails after its
first call: it is cut (agent_error), masked, counted, and the run goes on. The check that
holds it together is the engine's log-probs against the actor's over each trained
sample's loss mask, as in test_multi_turn_run.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from rlhf_trainer.api.config import JobConfig

pytestmark = pytest.mark.slow  # a whole run

STEPS = 2
EPISODES_A_STEP = 8  # batchSize 4, samplesPerPrompt 2
FAILING_EPISODE = 3  # the agent's third episode raises after its first call
EDITED = STEPS * EPISODES_A_STEP // 2  # the even episodes summarise: two samples each
CALL_TOKENS = 4
LOG_PROB_TOLERANCE = 1e-4  # as test_multi_turn_run's
EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"

_started = itertools.count(1)  # in the agent's process: the episodes it was sent


async def run(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> float:
    """The test's agent: a question, the model's answer, a follow-up that extends it or,
    in an even episode, a call on a summary of it (which extends nothing)."""
    episode = next(_started)
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(task["key"])}]
    first = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=CALL_TOKENS
    )
    if episode == FAILING_EPISODE:
        raise RuntimeError("the test's agent fails mid-episode")
    if episode % 2 == 0:
        messages = [{"role": "user", "content": f"summary: {task['key']} asked"}]
    else:
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "again"},
        ]
    second = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=CALL_TOKENS
    )
    return 1.0 + len(second.choices[0].message.content or "")


def agent_job(checkpoint_dir: Path) -> JobConfig:
    """examples/agentic-tools.yaml (GRPO, one pool) with this module's agent in place of
    its environment. The engine's context (maxPromptLength + maxResponseLength) holds an
    episode's two calls."""
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    del spec["environments"]
    spec["agents"] = [{"name": "counting", "serve": f"{__name__}:run"}]
    spec["generation"] = {
        "gpuMemoryUtilization": 0.3,
        "samplesPerPrompt": 2,
        "agent": {"agent": "counting", "maxCallTokens": CALL_TOKENS, "maxCalls": 4},
    }
    spec["data"] = {"train": "toy:lookup", "maxPromptLength": 8, "maxResponseLength": 56}
    spec["trainer"] = {
        "totalSteps": STEPS,
        "batchSize": 4,
        "miniBatchSize": 8,
        "actorLearningRate": 1e-3,
        "checkpoint": {"path": str(checkpoint_dir), "everySteps": STEPS},
    }
    return JobConfig.model_validate(spec)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlhf_trainer.cluster.local import local_environments
    from tests.trainer.local_runs import train

    config = agent_job(tmp_path_factory.mktemp("agent") / "checkpoints")
    with local_environments(config) as served:
        assert served.agents[0].url is not None and served.agents[0].serve is None
        return train(served)


def value(trained: Any, name: str, labels: dict[str, str] | None = None) -> float:
    found = trained.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if found is None else float(found)


def test_agent_episodes_are_trained_with_the_engines_log_probs(trained: Any) -> None:
    assert [s.step for s in trained.steps] == list(range(1, STEPS + 1))
    for step in trained.steps:
        assert step.episodes is not None and len(step.episodes.episodes) == EPISODES_A_STEP
        # The loss mask covers the sampled tokens, which the actor scores as the engine did.
        assert step.response_tokens > 0 and step.rollout_log_prob_diff < LOG_PROB_TOLERANCE
    # Every sample of a finished episode is trained: a summarising one's two.
    assert value(trained, "rlhf_agent_samples_left_out_total") == 0
    rows = STEPS * EPISODES_A_STEP
    done = sum(e.cut is None for step in trained.steps for e in step.episodes.episodes)
    assert rows + EDITED <= sum(step.samples for step in trained.steps) <= rows + done
    sampled = value(trained, "rlhf_agent_tokens_total", {"kind": "sampled"})
    trained_tokens = sum(step.response_tokens for step in trained.steps)
    # Trained: every call the finished episodes sampled, never the cut one's first call.
    assert sampled - CALL_TOKENS <= trained_tokens < sampled


def test_the_reward_is_the_agents(trained: Any) -> None:
    for step in trained.steps:  # >= 1 each, 0 for the one cut (masked): at least 7/8
        assert step.reward_mean >= (EPISODES_A_STEP - 1) / EPISODES_A_STEP, step


def test_an_agent_that_fails_mid_episode_is_cut_counted_and_the_run_goes_on(
    trained: Any,
) -> None:
    episodes = [e for step in trained.steps for e in step.episodes.episodes]
    cuts = [e.cut for e in episodes if e.cut is not None]
    assert len(cuts) == 1 and cuts[0].startswith("agent_error: "), cuts
    assert "fails mid-episode" in cuts[0]
    total = STEPS * EPISODES_A_STEP
    assert value(trained, "rlhf_agent_episodes_total", {"outcome": "agent_error"}) == 1
    assert value(trained, "rlhf_agent_episodes_total", {"outcome": "done"}) == total - 1
    assert value(trained, "rlhf_agent_calls_total") == 2 * total - 1
