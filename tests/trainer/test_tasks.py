"""toy:copy prompts and the toy_copy reward rule."""

from __future__ import annotations

import pytest

from rlhf_trainer.data.tasks import (
    REWARD_FUNCTIONS,
    copy_prompts,
    prompt_letters,
    toy_copy,
    toy_prompts,
)


def test_prompts_are_seeded_and_well_formed() -> None:
    prompts = copy_prompts(50, seed=7)
    assert prompts == copy_prompts(50, seed=7)
    assert prompts != copy_prompts(50, seed=8)
    for prompt in prompts:
        symbols = prompt.text.split()
        assert len(symbols) == 4 and symbols[-1] == "="
        assert all(s in "abcdefgh" for s in symbols[:-1])
        assert toy_copy(prompt.text, prompt.ideal_response) == 1.0
    assert toy_prompts("toy:copy", 3, seed=1) == copy_prompts(3, seed=1)
    assert len(copy_prompts(1, seed=0, length=6)[0].text.split()) == 7


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("c a f e </s>", 1.0),  # the exact copy, then stop
        ("c a f e", 4 / 5),  # did not stop
        ("c a f e e e e", (4 + 0.5) / 5),  # kept going with a prompt letter
        ("c f a e </s>", (1 + 0.5 + 0.5 + 1 + 1) / 5),  # prompt letters, two swapped
        ("x y z w </s>", (4 * 0.25 + 1) / 5),  # letters, but not the prompt's
        ("<extra_3> 7 </s>", 0.0),  # fillers and digits earn nothing
        ("", 0.0),
        ("</s>", 0.0),  # stopping at once is the wrong place for the stop
        ("c", 1 / 5),
    ],
)
def test_toy_copy_reward_rule(response: str, score: float) -> None:
    assert toy_copy("c a f e =", response) == pytest.approx(score)


def test_prompt_letters_ignore_bos_and_the_separator() -> None:
    assert prompt_letters("<s> c a f e =") == ["c", "a", "f", "e"]
    assert prompt_letters("c a") == ["c", "a"]


def test_builtin_names() -> None:
    assert REWARD_FUNCTIONS["toy_copy"] is toy_copy
    with pytest.raises(ValueError, match="not a built-in task"):
        toy_prompts("toy:sort", 1, 0)
    with pytest.raises(ValueError, match="not a built-in task"):
        toy_prompts("/data/train.jsonl", 1, 0)
