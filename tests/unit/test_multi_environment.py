"""Several environments per job, chosen per data row (issue 72, item 9): a row's
`environment` column picks the environments[] entry its episode runs in, and
generation.multiTurn.environment is the default for rows without it.

The episodes run through the real EpisodeRunners that a rollout rank builds from the
job (rollout.worker.episode_runner), against two toy environments of rlhf_env/toys.py,
each on the real protocol server (tests/environments.py: uvicorn in a thread), the
calculator refusing a row with any column but its own. The
engine is a script (a stand-in for vLLM): it samples each row's ideal turns in the tiny
models' words, so a row played in the other environment would score 0 or fail, never 1.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_env.protocol import Start
from rlhf_env.server import app_for
from rlhf_env.toys import Calculator, LetterLookup
from rlhf_operator.api.validation import parse_job
from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.rollout.episodes import (
    EnvironmentUnreachable,
    check_episodes,
    environments_used,
)
from tests import environments
from tests.unit.celcheck import assert_refused

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"

# Each row, and the turns of its ideal episode: LetterLookup's (look the key up, answer
# its value) and Calculator's (calculate, answer the sum).
ROWS: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"key": "c", "value": "x"}, ("call c", "x")),  # no column: multiTurn.environment's
    ({"environment": "calc", "numbers": [1, 2]}, ("call 3", "3")),
    ({"environment": "lookup", "key": "d", "value": "y"}, ("call d", "y")),
    ({"environment": "calc", "numbers": [4, 5]}, ("call 9", "9")),
]


def manifest(default: str | None = "lookup") -> dict[str, Any]:
    """The agentic example with two environments served by class; `default`:
    multiTurn.environment (None: unset)."""
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    job["spec"]["environments"] = [
        {"name": "lookup", "serve": "rlhf_env.toys:LetterLookup"},
        {"name": "calc", "serve": "rlhf_env.toys:Calculator"},
    ]
    job["spec"]["data"]["maxResponseLength"] = 4  # "call 3" and the end of the turn
    multi_turn = job["spec"]["generation"]["multiTurn"]
    multi_turn.update(maxTokens=256)  # Calculator's question is a sentence
    multi_turn.pop("environment")
    if default is not None:
        multi_turn["environment"] = default
    return job


def job_config(default: str | None = "lookup") -> JobConfig:
    return parse_job(manifest(default)).spec.job_config()


class StrictCalculator(Calculator):
    """Calculator, refusing any column but its own (as an environment that validates its
    rows strictly does): the column that chose it never reaches it."""

    def reset(self, row: dict[str, Any]) -> Start:
        if set(row) != {"numbers"}:
            raise ValueError(f"unexpected columns: {sorted(set(row) - {'numbers'})}")
        return super().reset(row)


def at(config: JobConfig, urls: dict[str, str]) -> JobConfig:
    """The job with each environment at its url, as the driver gets it in a cluster."""
    environments = [
        e.model_copy(update={"url": urls[e.name], "serve": None}) for e in config.environments
    ]
    return config.model_copy(update={"environments": environments})


@pytest.fixture(scope="module")
def served() -> Iterator[JobConfig]:
    """The job with both environments served, each by its real server."""
    with environments.served(
        {"lookup": app_for(LetterLookup), "calc": app_for(StrictCalculator)}
    ) as url:
        yield at(job_config(), {"lookup": f"{url}/lookup", "calc": f"{url}/calc"})


def play(config: JobConfig, rows: list[tuple[dict[str, Any], tuple[str, ...]]]) -> list[Rollout]:
    """Each row's episode, at once, through the runners a rollout rank builds."""
    from rlhf_trainer.rollout.worker import episode_runner

    runners = episode_runner(config)
    assert runners is not None
    tokenizer, end = runners.renderer.tokenizer, runners.renderer.end_of_turn_id

    async def episode(row: dict[str, Any], turns: tuple[str, ...]) -> Rollout:
        script = [[*tokenizer.encode(t, add_special_tokens=False), end] for t in turns]

        async def engine(prompt: list[int], max_tokens: int) -> Rollout:
            ids = script.pop(0)[:max_tokens]
            return Rollout(prompt, ids, [-0.5] * len(ids), ids[-1] == end, 0)

        return await runners.run(row, engine, 0)

    async def all_of_them() -> list[Rollout]:
        try:
            return list(await asyncio.gather(*(episode(r, t) for r, t in rows)))
        finally:
            await runners.aclose()

    return asyncio.run(all_of_them())


def test_each_row_plays_in_the_environment_its_column_names(served: JobConfig) -> None:
    rows = [row for row, _ in ROWS]
    assert environments_used(served, rows) == ["lookup", "calc"]
    check_episodes(served, rows)  # each answers its health check
    rollouts = play(served, ROWS)
    episodes = [r.episode for r in rollouts]
    assert [e.environment if e else None for e in episodes] == ["lookup", "calc", "lookup", "calc"]
    # The ideal episode of each: scored 1 by its own environment, two turns, one call.
    assert [(e.cut, e.score, e.turns, e.tool_calls) if e else None for e in episodes] == [
        (None, 1.0, 2, 1)
    ] * 4


def test_a_row_in_another_environment_is_not_its_episode(served: JobConfig) -> None:
    """The same scripts with the columns swapped: a lookup row's reset fails in
    Calculator (no numbers: an HTTP 500, a cut), a calculator row scores 0 in
    LetterLookup. So the 1s above come from the routing, not from the scripts."""
    swapped = [
        ({"environment": "calc", "key": "c", "value": "x"}, ("call c", "x")),
        ({"environment": "lookup", "numbers": [1, 2], "key": "a", "value": "b"}, ("call 3", "3")),
    ]
    to_calc, to_lookup = (r.episode for r in play(served, swapped))
    assert to_calc is not None and to_calc.environment == "calc"
    assert to_calc.cut is not None and to_calc.cut.startswith("environment_error"), to_calc.cut
    assert to_lookup is not None and (to_lookup.environment, to_lookup.score) == ("lookup", 0.25)


def test_an_environment_no_row_uses_is_not_checked_one_a_row_uses_is() -> None:
    """The driver health-checks the environments the rows name (and the default's, for
    rows without the column), each naming itself when it does not answer."""
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens
    config = at(job_config(), {"lookup": closed, "calc": closed})
    with pytest.raises(EnvironmentUnreachable, match="'calc' did not answer within 1 s"):
        check_episodes(config, [{"environment": "calc"}], wait_seconds=1)
    with pytest.raises(EnvironmentUnreachable, match="'lookup' did not answer"):
        check_episodes(config, [{"key": "a"}], wait_seconds=1)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps({"prompt": "", **row}) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize(
    ("default", "rows", "words"),
    [
        ("lookup", [{"key": "a"}, {"environment": "calc"}, {"environment": "serach"}],
         "row 2, column 'environment': expected one of environments (lookup, calc), "
         "got 'serach'"),
        ("lookup", [{"environment": 7}], "row 0, column 'environment': expected one of "
         "environments (lookup, calc), got 7"),
        (None, [{"environment": "calc"}, {"key": "a"}],
         "row 1, no column 'environment', and generation.multiTurn.environment (the default) "
         "is unset: name one of environments (lookup, calc) in the row, or set it"),
    ],
)  # fmt: skip
def test_a_row_naming_no_declared_environment_fails_the_data_load(
    tmp_path: Path, default: str | None, rows: list[dict[str, Any]], words: str
) -> None:
    """At load (loop.setup.load_inputs, before Ray or any environment call), naming the
    source, the row, the column and the declared names."""
    from rlhf_trainer.loop.setup import load_inputs

    config = job_config(default)
    data = config.data.model_copy(update={"train": write_rows(tmp_path / "rows.jsonl", rows),
                                          "eval": None})  # fmt: skip
    trainer = config.trainer.model_copy(update={"eval_every_steps": None})
    config = config.model_copy(update={"data": data, "trainer": trainer})
    with pytest.raises(ValueError, match=r"^data\.train: ") as failed:
        load_inputs(config, None)
    assert f"rows.jsonl: {words}" in str(failed.value)


def test_the_default_may_be_unset_and_must_be_declared_when_set() -> None:
    assert job_config(None).multi_turn is not None
    assert_refused(
        manifest("search"),
        "spec.generation.multiTurn.environment",
        "must name one of environments (got 'search'; declared: lookup, calc)",
        cel_too=True,
    )
    none = manifest(None)
    none["spec"]["environments"] = []
    assert_refused(none, "spec.environments", "must declare at least one environment", True)
