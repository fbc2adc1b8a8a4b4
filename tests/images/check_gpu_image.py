"""Check the GPU trainer image where there is no GPU, as `make image-trainer-gpu` does
after building it:

    python3 -m tests.images.check_gpu_image            # localhost/rlhf-trainer:VERSION
    python3 -m tests.images.check_gpu_image REF

A working container of the image (from buildah's storage, never pulled) runs
tests/images/inside_gpu_image.py as the image's user, with that script and the
repository's examples/ mounted read-only: it imports rlhf_trainer, vLLM's CUDA build,
vLLM's NCCL and IPC weight-transfer engines and vLLM's CUDA kernels (over a stub of the
NVIDIA driver's libcuda.so.1, which they link and which only a GPU node has), and runs
`rlhfjob validate` on every example. It prints one line per check; the exit status is
non-zero when any failed."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.images.build import IMAGES, ROOT, run

SCRIPT = Path(__file__).with_name("inside_gpu_image.py")
MOUNT = "/check"  # in the container: the script and examples/, read-only


def run_command(container: str, root: Path = ROOT) -> list[str]:
    """`buildah run` of the checks in `container`, from MOUNT (the examples' paths print
    as examples/NAME.yaml)."""
    return [
        "buildah",
        "run",
        f"--isolation={os.environ.get('BUILDAH_ISOLATION', 'chroot')}",
        f"--volume={SCRIPT}:{MOUNT}/{SCRIPT.name}:ro",
        f"--volume={root / 'examples'}:{MOUNT}/examples:ro",
        f"--workingdir={MOUNT}",
        container,
        "--",
        "python",
        f"{MOUNT}/{SCRIPT.name}",
        "examples",
    ]


def check(ref: str) -> int:
    """Run the checks in a working container of `ref`, removed afterwards; their status."""
    container = run("buildah", "from", "--quiet", "--pull=never", ref, capture=True)
    try:
        return subprocess.run(run_command(container), check=False).returncode
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ref", nargs="?", default=IMAGES["trainer-gpu"].ref, metavar="REF")
    args = parser.parse_args(argv)
    try:
        status = check(args.ref)
    except subprocess.CalledProcessError as error:
        parser.exit(1, f"{shlex.join(error.cmd)}: exit status {error.returncode}\n")
    if status:
        parser.exit(1, f"{args.ref}: the image's checks failed (exit status {status})\n")
    print(f"{args.ref}: checked")


if __name__ == "__main__":
    main()
