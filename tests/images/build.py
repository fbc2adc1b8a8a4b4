"""Build the images with buildah, no Docker engine and no container registry.

    python3 -m tests.images.build                 # the operator and the CPU trainer
    python3 -m tests.images.build trainer-gpu     # the GPU trainer, only where asked

The base, `localhost/rlhf-base:bookworm`, is Debian bookworm with python3 made by
mmdebstrap from Debian's mirrors, as a local image: the Dockerfiles' public default
(python:3.11.7-slim-bookworm) cannot be pulled where no registry is reachable, and both
serve the Dockerfiles alike (`python3 -m venv /opt/venv`). Each image is labelled with a
digest of its inputs (the Dockerfile, the files it copies, its build arguments, the base's
id): when the image in buildah's storage carries the same digest, nothing is built. Else
buildah builds with its layer cache, so a code change re-runs only the layers after the
code's COPY, never the stack's install.

RUN steps run with chroot isolation: the default (OCI, through runc) sets rlimits that
some VMs refuse, and a build needs no more isolation than chroot's."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
LABEL = "dev.rlhf.inputs"  # the digest of an image's inputs
LOCK = Path("/var/tmp/rlhf-images.lock")  # one build at a time (two pytest workers may ask)

BASE_REF = "localhost/rlhf-base:bookworm"
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Like Debian's -slim images: no manuals, documentation (but copyrights) or translations.
# The options stay in the image's dpkg configuration, so later installs follow them.
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
)
BASE_CONFIG = ("--env", "LANG=C.UTF-8", "--cmd", "/bin/bash")


@dataclass(frozen=True)
class Image:
    ref: str
    dockerfile: str
    inputs: tuple[str, ...]  # what the Dockerfile copies: files and folders under ROOT
    build_args: tuple[tuple[str, str], ...] = ()


_CODE = ("pyproject.toml", "constraints.txt", "README.md", "operator", "trainer_image/rlhf_trainer")
_TRAINER = (
    *_CODE,
    "trainer_image/rlhf_env",
    "trainer_image/requirements-cpu.in",
    "trainer_image/requirements-cpu.txt",
    "trainer_image/stub_cuda_libraries.py",
)
IMAGES = {
    "operator": Image(f"localhost/rlhf-operator:{VERSION}", "operator/Dockerfile", _CODE),
    "trainer-cpu": Image(
        f"localhost/rlhf-trainer:{VERSION}-cpu",
        "trainer_image/Dockerfile",
        _TRAINER,
        (("STACK", "cpu"),),
    ),
    "environment": Image(
        f"localhost/rlhf-environment:{VERSION}",
        "environment_image/Dockerfile",
        (
            *_CODE[:3],
            "trainer_image/requirements-cpu.txt",
            "trainer_image/rlhf_env",
            "examples/agents",  # the example agent, served from this image
        ),
    ),
    "trainer-gpu": Image(
        f"localhost/rlhf-trainer:{VERSION}",
        "trainer_image/Dockerfile",
        _TRAINER,
        (("STACK", "gpu"),),
    ),
}
DEFAULT = ("operator", "trainer-cpu", "environment")


def run(*command: str, capture: bool = False) -> str:
    result = subprocess.run(
        command, check=True, text=True, stdout=subprocess.PIPE if capture else None
    )
    return result.stdout.strip() if capture else ""


def inspect(ref: str, template: str) -> str | None:
    """A field of an image in buildah's storage; None when there is no such image."""
    result = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", template, ref],
        text=True,
        capture_output=True,
    )
    return result.stdout.strip() if result.returncode == 0 else None


def image_id(ref: str) -> str | None:
    """The image's id: the digest of its config, which an archive and containerd keep."""
    found = inspect(ref, "{{.FromImageID}}")
    return f"sha256:{found}" if found else None


def inputs_label(ref: str) -> str | None:
    return inspect(ref, f'{{{{index .OCIv1.Config.Labels "{LABEL}"}}}}') or None


# --- what the build context shows the Dockerfiles (.dockerignore) ---


def ignore_patterns(root: Path = ROOT) -> list[str]:
    path = root / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")]


def _regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus ** for any folders) as a regex."""
    parts, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        else:
            char = pattern[i]
            parts.append({"*": "[^/]*", "?": "[^/]"}.get(char, re.escape(char)))
            i += 1
    return re.compile("".join(parts))


def ignored(relative: str, patterns: Sequence[str]) -> bool:
    """Docker's rule: the last pattern that matches the path, or a folder above it, decides."""
    prefixes = ["/".join(relative.split("/")[:n]) for n in range(1, relative.count("/") + 2)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if any(_regex(pattern.lstrip("!")).fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def input_files(image: Image, root: Path = ROOT) -> Iterator[Path]:
    patterns = ignore_patterns(root)
    for name in sorted({image.dockerfile, *image.inputs}):
        top = root / name
        paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in paths:
            if not ignored(path.relative_to(root).as_posix(), patterns):
                yield path


def inputs_digest(image: Image, base_id: str, root: Path = ROOT) -> str:
    """sha256 of everything the build reads: a change to any of it means a new image."""
    digest = hashlib.sha256()
    header = {"dockerfile": image.dockerfile, "build_args": image.build_args, "base": base_id}
    digest.update(json.dumps(header, sort_keys=True).encode() + b"\0")
    for path in input_files(image, root):
        content = path.read_bytes()
        mode = path.stat().st_mode & 0o777
        name = path.relative_to(root).as_posix()
        digest.update(f"{name}\0{mode:o}\0{len(content)}\0".encode() + content)
    return digest.hexdigest()


# --- the base ---


def base_digest() -> str:
    recipe = [SUITE, MIRRORS, BASE_PACKAGES, DPKG_OPTIONS, BASE_CONFIG]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()


def ensure_base() -> str:
    """The base image's id, made first if missing or made from another recipe (about a minute)."""
    digest = base_digest()
    if inputs_label(BASE_REF) == digest and (found := image_id(BASE_REF)):
        return found
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        rootfs = Path(scratch) / "rootfs.tar"
        run(
            "mmdebstrap",
            "--quiet",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            *(f"--dpkgopt={option}" for option in DPKG_OPTIONS),
            '--aptopt=Acquire::Languages "none"',
            SUITE,
            str(rootfs),
            *MIRRORS,
        )
        container = run("buildah", "from", "--quiet", "scratch", capture=True)
        try:
            run("buildah", "add", "--quiet", container, str(rootfs), "/")
            run("buildah", "config", *BASE_CONFIG, "--label", f"{LABEL}={digest}", container)
            run("buildah", "commit", "--quiet", "--format", "docker", container, BASE_REF)
        finally:
            subprocess.run(["buildah", "rm", container], capture_output=True)
    print(f"{BASE_REF}: made in {time.monotonic() - started:.0f} s", file=sys.stderr)
    found = image_id(BASE_REF)
    assert found, f"{BASE_REF} missing right after its commit"
    return found


# --- the images ---


def ca_bundle_volume() -> list[str]:
    """The build machine's CA bundle over the image's, during RUN steps only (never in a
    layer): where PyPI is reached through a TLS-inspecting proxy, only the host trusts it."""
    bundle = (
        os.environ.get("PIP_CERT")
        or os.environ.get("SSL_CERT_FILE")
        or "/etc/ssl/certs/ca-certificates.crt"
    )
    return (
        ["--volume", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro"]
        if Path(bundle).is_file()
        else []
    )


def build(name: str, base_id: str) -> str:
    """Build one image unless one with the same inputs is there; its reference."""
    image = IMAGES[name]
    digest = inputs_digest(image, base_id)
    if inputs_label(image.ref) == digest:
        print(f"{image.ref}: up to date ({LABEL}={digest[:12]})", file=sys.stderr)
        return image.ref
    started = time.monotonic()
    build_args = [("BASE", BASE_REF), *image.build_args]
    run(
        "buildah",
        "bud",
        "--layers",
        "--format=docker",  # the config an archive for containerd keeps as is (same image id)
        f"--isolation={os.environ.get('BUILDAH_ISOLATION', 'chroot')}",
        *(f"--build-arg={key}={value}" for key, value in build_args),
        f"--label={LABEL}={digest}",
        *ca_bundle_volume(),
        f"--file={ROOT / image.dockerfile}",
        f"--tag={image.ref}",
        str(ROOT),
    )
    print(f"{image.ref}: built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return image.ref


def ensure(names: Sequence[str] = DEFAULT) -> dict[str, str]:
    """Build what is missing or stale, one build at a time on this machine; name -> reference."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        base_id = ensure_base()
        return {name: build(name, base_id) for name in names}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"images to build: {', '.join(IMAGES)} (default: {' '.join(DEFAULT)})",
    )
    parser.add_argument("--list", action="store_true", help="print each image's reference and stop")
    args = parser.parse_args(argv)
    names = args.names or list(DEFAULT)
    if unknown := [name for name in names if name not in IMAGES]:
        parser.error(f"no image {', '.join(unknown)}; there are {', '.join(IMAGES)}")
    if args.list:
        print("\n".join(IMAGES[name].ref for name in names))
        return
    try:
        refs = ensure(names)
    except subprocess.CalledProcessError as error:
        parser.exit(1, f"{shlex.join(error.cmd)}: exit status {error.returncode}\n")
    print("\n".join(refs.values()))


if __name__ == "__main__":
    main()
