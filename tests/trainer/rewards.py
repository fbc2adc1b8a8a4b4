"""Rule-based rewards for the tests, named in specs as `tests.trainer.rewards:<name>`."""

from __future__ import annotations

from rlhf_trainer.data.tasks import LETTERS, math_answer


def starts_with_a_letter(prompt: str, response: str) -> float:
    """1 when the response starts with a letter, else 0: a binary reward under which a
    young policy's groups are often all 0 or all 1 (what dynamic sampling drops)."""
    words = response.split()
    return float(bool(words) and words[0] in LETTERS)


def constant(prompt: str, response: str) -> float:
    """Every response alike: no group ever teaches anything."""
    return 0.5


SCORED: list[tuple[str, str, float]] = []  # (prompt, response, reward) as the driver saw them


def math_answer_seen(prompt: str, response: str, answer: str) -> float:
    """The built-in math_answer, remembering what it was asked to score (the driver
    scores in the test's own process)."""
    reward = math_answer(prompt, response, answer)
    SCORED.append((prompt, response, reward))
    return reward
