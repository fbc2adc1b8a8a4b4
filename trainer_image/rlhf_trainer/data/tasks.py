"""Built-in toy tasks (`data.train: toy:<task>`) and rule-based rewards, made from a seed.

toy:copy - the prompt is three random letters from a-h and "=": `<s> c a f =`. The
ideal response copies the letters in order and stops: `c a f </s>`. One letter string
in 8 is held out: training never shows it, and `toy:copy:heldout` is those 64 prompts,
for data.eval (a model that only memorised its training prompts fails them).

Reward `toy_copy` (in [0, 1]): the targets are the k prompt letters, then the end of
sequence (k + 1 targets). Response token i earns, against target i:
  1    the exact target;
  0.5  a letter of the prompt in the wrong place;
  0.25 any other letter (a-z);
  0    anything else (a filler token, a digit, a missing token).
The score is the mean over the targets; tokens past them earn nothing (so going on
instead of stopping loses the last target's credit).

Why this shape: a random-initialised tiny model samples nearly uniformly over its
vocabulary, so an exact-copy-only reward would almost never fire. The graded credit
gives PPO a signal from the first batch and a ladder to climb: emit letters (a bias a
tiny model learns in a few steps), then the prompt's letters (attention as a bag of
tokens), then each letter in its place and the stop (positional copying). Short
prompts over 8 letters keep the last rung within reach: measured with a plain PPO loop
over these pieces (transformers generate, batch 32, actor lr 1e-3, critic lr 1e-3,
klCoef 0.01, 2 CPU cores), the default tiny qwen2 with a 64-token vocabulary went from
a mean reward of 0.10 to 0.52 by step 200 and 0.88 by step 350 (~80 s), answering
`h a d </s>`; with the 512-token vocabulary from 0.02 to 0.65 by step 400 (~105 s).
With actor lr 1e-4 the rise over 30 steps is small (0.01 -> 0.03).

toy:lookup - multi-turn, for the environment rlhf_env.toys:LetterLookup: a row is a key
and its value, two random letters from a-h, `{"key": "c", "value": "x"}`. It has no
prompt text: the environment opens the conversation, and scores it. One (key, value)
pair in 8 is held out by the same stable hash as toy:copy's strings:
`toy:lookup:heldout` is those 8 rows.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import random
import re
import string
import sys
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from rlhf_trainer.api.names import REWARD_FILES_ENV, REWARD_FILES_MOUNT
from rlhf_trainer.api.reward import RewardSource, file_function, is_file_function
from rlhf_trainer.models import BOS, EOS, SEPARATOR

LETTERS = string.ascii_lowercase  # every letter earns the "a letter" credit
COPY_ALPHABET = LETTERS[:8]  # the letters prompts are made of
COPY_LENGTH = 3  # letters per prompt: short enough to learn in minutes on a CPU
HELD_OUT_EVERY = 8  # toy:copy:heldout: 1 in 8 letter strings (64 of the 512), never trained

# (prompt text, response text, **the dataset row's other columns) -> score. The response
# is decoded with special tokens kept (one that stopped ends in the EOS token).
RewardFunction = Callable[..., float]


@dataclass(frozen=True)
class TaskPrompt:
    text: str  # what the tokenizer encodes, without <s> (it adds that)
    ideal_response: str  # a response that scores 1.0


def copy_prompts(
    count: int, seed: int, length: int = COPY_LENGTH, alphabet: str = COPY_ALPHABET
) -> list[TaskPrompt]:
    """`count` toy:copy prompts of `length` random letters, none of them held out; the
    same seed, the same list."""
    rng = random.Random(seed)
    prompts: list[TaskPrompt] = []
    while len(prompts) < count:
        letters = [rng.choice(alphabet) for _ in range(length)]
        if not is_held_out(letters):
            prompts.append(copy_prompt(letters))
    return prompts


def copy_held_out_prompts(
    length: int = COPY_LENGTH, alphabet: str = COPY_ALPHABET
) -> list[TaskPrompt]:
    """toy:copy:heldout - every letter string that training never shows, in order."""
    strings = itertools.product(alphabet, repeat=length)
    return [copy_prompt(list(letters)) for letters in strings if is_held_out(letters)]


def is_held_out(letters: Sequence[str]) -> bool:
    """One letter string in HELD_OUT_EVERY, by a stable hash (not by position, which
    would hold out, say, every string ending in one letter)."""
    return zlib.crc32(" ".join(letters).encode()) % HELD_OUT_EVERY == 0


def copy_prompt(letters: Sequence[str]) -> TaskPrompt:
    return TaskPrompt(
        text=" ".join([*letters, SEPARATOR]), ideal_response=" ".join([*letters, EOS])
    )


def lookup_rows(count: int, seed: int, alphabet: str = COPY_ALPHABET) -> list[dict[str, str]]:
    """`count` toy:lookup rows, none of them held out; the same seed, the same list."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while len(rows) < count:
        key, value = rng.choice(alphabet), rng.choice(alphabet)
        if not is_held_out([key, value]):
            rows.append({"key": key, "value": value})
    return rows


def lookup_held_out_rows(alphabet: str = COPY_ALPHABET) -> list[dict[str, str]]:
    """toy:lookup:heldout - every (key, value) pair that training never shows, in order."""
    pairs = itertools.product(alphabet, repeat=2)
    return [{"key": k, "value": v} for k, v in pairs if is_held_out([k, v])]


def prompt_letters(prompt: str) -> list[str]:
    """The letters a toy:copy prompt asks to copy: the symbols before "=" (no <s>)."""
    symbols = prompt.split()
    if SEPARATOR in symbols:
        symbols = symbols[: symbols.index(SEPARATOR)]
    return [s for s in symbols if s != BOS]


def toy_copy(prompt: str, response: str) -> float:
    """Score a toy:copy response (see the module doc for the rule).

    `response` is the decoded response with special tokens kept, so a response that
    stopped ends in "</s>".
    """
    letters = prompt_letters(prompt)
    targets = [*letters, EOS]
    said = response.split()
    credit = 0.0
    for target, token in zip(targets, said, strict=False):
        if token == target:
            credit += 1.0
        elif token in letters:
            credit += 0.5
        elif token in LETTERS:
            credit += 0.25
    return credit / len(targets)


def math_answer(prompt: str, response: str, answer: str | float | int, **_: Any) -> float:
    """A verifiable reward: 1.0 when the last number in the response equals the row's
    `answer` column, else 0.0. An example of a reward that reads the dataset's columns."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response.replace(",", ""))
    try:
        return float(bool(numbers) and float(numbers[-1]) == float(answer))
    except ValueError:  # an answer that is not a number
        return 0.0


REWARD_FUNCTIONS: dict[str, RewardFunction] = {"toy_copy": toy_copy, "math_answer": math_answer}


def check_reward_arguments(reward: RewardFunction, columns: Iterable[str], source: str) -> None:
    """Fail at start, not at the first step, when the columns of the dataset `source`
    (data.train, data.eval) cannot be passed to the reward function (they go as
    keyword arguments)."""
    parameters = inspect.signature(reward).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    accepted = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra = sorted(set(columns) - accepted)
    if extra:
        name = getattr(reward, "__name__", repr(reward))
        raise ValueError(
            f"models.reward.function: {name} does not take the columns {extra} of {source} "
            "(each row's other columns are passed as keyword arguments; add them or **kwargs)"
        )


# Single-turn tasks: prompts for the policy. Multi-turn tasks: rows for an environment.
TASKS: dict[str, Callable[[int, int], list[TaskPrompt]]] = {"copy": copy_prompts}
HELD_OUT: dict[str, Callable[[], list[TaskPrompt]]] = {"copy": copy_held_out_prompts}
MULTI_TURN_TASKS: dict[str, Callable[[int, int], list[dict[str, str]]]] = {"lookup": lookup_rows}
MULTI_TURN_HELD_OUT: dict[str, Callable[[], list[dict[str, str]]]] = {
    "lookup": lookup_held_out_rows
}


def toy_task(source: str) -> tuple[str, bool]:
    """The task a `toy:<task>` or `toy:<task>:heldout` data source names, and whether it
    is the held-out split."""
    kind, _, task = source.partition(":")
    task, _, split = task.partition(":")
    if kind != "toy" or task not in (*TASKS, *MULTI_TURN_TASKS) or split not in ("", "heldout"):
        known = ", ".join(f"toy:{t}, toy:{t}:heldout" for t in (*TASKS, *MULTI_TURN_TASKS))
        raise ValueError(f"not a built-in task: {source!r} (known: {known})")
    return task, split == "heldout"


def is_multi_turn_task(source: str) -> bool:
    """Whether a `toy:` data source's rows go to an environment rather than the policy."""
    return toy_task(source)[0] in MULTI_TURN_TASKS


def toy_prompts(source: str, count: int, seed: int) -> list[TaskPrompt]:
    """Prompts of a single-turn `toy:<task>` data source: `count` of them, generated from
    `seed`; or `toy:<task>:heldout`, the task's held-out split (every prompt of it, once)."""
    task, held_out = toy_task(source)
    if task not in TASKS:
        raise ValueError(f"{source!r} is a multi-turn task: it has rows (toy_rows), no prompts")
    return HELD_OUT[task]() if held_out else TASKS[task](count, seed)


def toy_rows(source: str, count: int, seed: int) -> list[dict[str, str]]:
    """Rows of a multi-turn `toy:<task>` data source, for its environment: `count` of
    them, generated from `seed`; or the task's held-out split (every row of it, once)."""
    task, held_out = toy_task(source)
    if task not in MULTI_TURN_TASKS:
        raise ValueError(f"{source!r} is a single-turn task: it has prompts (toy_prompts)")
    return MULTI_TURN_HELD_OUT[task]() if held_out else MULTI_TURN_TASKS[task](count, seed)


def reward_function(source: RewardSource, files: Path | None = None) -> RewardFunction | None:
    """The rule-based reward the spec names: built in, `module:function`, or
    `file:NAME.py:FUNCTION` read from the directory `files` (default: reward_files());
    None when the reward is not a function. Call it once: a file is imported anew."""
    if source.function is None:
        return None
    if source.function in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[source.function]
    if is_file_function(source.function):
        return _function_in_file(source.function, files or reward_files())
    module, _, name = source.function.partition(":")
    if not name:
        raise ValueError(
            f"models.reward.function: {source.function!r} is not built in "
            f"({', '.join(REWARD_FUNCTIONS)}); name one as 'module:function'"
        )
    function: RewardFunction = getattr(importlib.import_module(module), name)
    return function


def reward_files() -> Path:
    """Where `file:` rewards are read: the operator's mount of models.reward.configMap,
    unless RLHF_REWARD_FILES names another directory."""
    return Path(os.environ.get(REWARD_FILES_ENV) or REWARD_FILES_MOUNT)


def _function_in_file(function: str, files: Path) -> RewardFunction:
    """FUNCTION of `file:NAME.py:FUNCTION`, from `files`/NAME.py."""
    file_name, name = file_function(function)
    path = files / file_name
    where = f"models.reward.function: {function!r}"
    if not path.is_file():
        raise ValueError(
            f"{where}: no file {path} (expected {file_name}, a key of models.reward.configMap, "
            f"mounted at {files}; a local run reads it from the manifest's directory)"
        )
    module = _import_file(path, where)
    found = getattr(module, name, None)
    if found is None or inspect.isclass(found) or not callable(found):
        what = "nothing" if found is None else f"a {type(found).__name__}"
        raise ValueError(f"{where}: {path} has no function {name!r} (found {what} by that name)")
    return cast("RewardFunction", found)


def _import_file(path: Path, where: str) -> ModuleType:
    """The Python file at `path`, imported as a module of its own name (one per file)."""
    name = f"rlhf_reward_file_{zlib.crc32(str(path.resolve()).encode()):08x}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in the file looks its module up there
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a user's file may fail in any way while importing
        del sys.modules[name]
        raise ValueError(
            f"{where}: cannot import {path}: {type(error).__name__}: {error}"
        ) from error
    return module
