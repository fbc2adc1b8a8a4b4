"""Put images from buildah's storage into a containerd (a node's), or into an archive.

    python3 -m tests.images.load --address /run/containerd/containerd.sock REF...
    python3 -m tests.images.load --address SOCKET --namespace k8s.io REF=NAME   # under NAME
    python3 -m tests.images.load --output rlhf-operator.tar REF                 # a docker archive

From Python: `load(ref, address)` -> the name containerd holds the image under.

The image travels as a docker archive streamed from `buildah push` into `ctr images
import` (no file, no compression), which unpacks it for containerd's default snapshotter:
a kubelet then starts it without a pull (imagePullPolicy IfNotPresent or Never). Nothing
is sent when containerd already holds the name with the same image id: the digest of the
image's config, which buildah's docker-format images keep through the archive. NAME is
stored as containerd and the kubelet spell it (`rlhf-trainer:0.1.0` is
`docker.io/library/rlhf-trainer:0.1.0`); `localhost/...` names stay as they are.

An archive (`--output`) serves clusters that load one: `kind load image-archive FILE`,
`minikube image load FILE`, `ctr -n k8s.io images import FILE`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.images.build import image_id

NAMESPACE = "k8s.io"  # the kubelet's (the CRI plugin's) namespace
CTR = os.environ.get("CTR", "ctr")
MANIFEST_LISTS = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


def normalize(name: str) -> str:
    """A reference as containerd's CRI stores it: registry and tag spelled out."""
    first, _, rest = name.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name}" if rest else f"docker.io/library/{name}"
    if "@" not in name and ":" not in name.rpartition("/")[2]:
        name += ":latest"
    return name


def _ctr(address: str, namespace: str, *args: str) -> str:
    command = [CTR, "--address", address, "--namespace", namespace, *args]
    return subprocess.run(command, check=True, text=True, capture_output=True).stdout


def containerd_image_id(name: str, address: str, namespace: str = NAMESPACE) -> str | None:
    """The config digest of the image `name` in that containerd; None when it has no such image."""
    listing = _ctr(address, namespace, "images", "list", f"name=={name}").splitlines()[1:]
    if not listing:
        return None
    digest = listing[0].split()[2]
    manifest = json.loads(_ctr(address, namespace, "content", "get", digest))
    if manifest.get("mediaType") in MANIFEST_LISTS or "manifests" in manifest:
        ours = [
            m for m in manifest["manifests"] if m.get("platform", {}).get("architecture") == "amd64"
        ]
        manifest = json.loads(
            _ctr(address, namespace, "content", "get", (ours or manifest["manifests"])[0]["digest"])
        )
    config: str = manifest["config"]["digest"]
    return config


def _push(ref: str, name: str, destination: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["buildah", "push", "--quiet", ref, f"docker-archive:{destination}:{name}"],
        stdout=subprocess.PIPE if destination == "/dev/stdout" else None,
    )


def collect_garbage(address: str, namespace: str, name: str) -> None:
    """Free what the image `name` replaced (a trainer image's stack is 7 GB): containerd
    collects unreferenced content and snapshots only after a deletion, so delete a second
    name of the image at once, synchronously."""
    spare = f"{name}-collect-garbage"
    _ctr(address, namespace, "images", "tag", "--force", name, spare)
    _ctr(address, namespace, "images", "rm", "--sync", spare)


def load(
    ref: str,
    address: str,
    namespace: str = NAMESPACE,
    name: str | None = None,
    snapshotter: str | None = None,
) -> str:
    """Import image `ref` of buildah's storage into the containerd listening on `address`
    (its socket), as `name` (default: `ref`), unless it holds that very image already.
    Returns the name as containerd stores it, the one a pod spec can use."""
    name = normalize(name or ref)
    wanted = image_id(ref)
    if wanted is None:
        raise LookupError(f"no image {ref} in buildah's storage (make images builds them)")
    if containerd_image_id(name, address, namespace) == wanted:
        print(f"{name}: already in {address} ({namespace})", file=sys.stderr)
        return name
    started = time.monotonic()
    push = _push(ref, name, "/dev/stdout")
    options = [f"--snapshotter={snapshotter}"] if snapshotter else []
    command = [
        CTR,
        "--address",
        address,
        "--namespace",
        namespace,
        "images",
        "import",
        *options,
        "-",
    ]
    imported = subprocess.run(command, stdin=push.stdout, stdout=subprocess.DEVNULL)
    assert push.stdout is not None
    push.stdout.close()
    if push.wait() != 0 or imported.returncode != 0:
        raise RuntimeError(
            f"loading {ref} into {address} failed: push {push.returncode}, import {imported.returncode}"
        )
    found = containerd_image_id(name, address, namespace)
    if found != wanted:
        raise RuntimeError(f"{name} in {address} has config {found} after the import, not {wanted}")
    collect_garbage(address, namespace, name)
    print(
        f"{name}: loaded into {address} ({namespace}) in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    return name


def save(ref: str, output: Path, name: str | None = None) -> Path:
    """Write image `ref` as a docker archive (uncompressed) at `output`, named `name`."""
    output.unlink(missing_ok=True)  # buildah refuses to add to an existing archive
    if _push(ref, normalize(name or ref), str(output)).wait() != 0:
        raise RuntimeError(f"writing {ref} to {output} failed")
    return output


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "images",
        nargs="+",
        metavar="REF[=NAME]",
        help="an image of buildah's storage, optionally renamed",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--address", help="containerd's socket, e.g. /run/containerd/containerd.sock"
    )
    where.add_argument(
        "--output", type=Path, help="write a docker archive here instead (one image)"
    )
    parser.add_argument(
        "--namespace", default=NAMESPACE, help=f"containerd namespace (default {NAMESPACE})"
    )
    parser.add_argument("--snapshotter", help="unpack for this snapshotter (default: containerd's)")
    args = parser.parse_args(argv)
    pairs = [
        (ref, name or None) for ref, _, name in (image.partition("=") for image in args.images)
    ]
    if args.output:
        if len(pairs) != 1:
            parser.error("--output takes one image")
        ref, name = pairs[0]
        print(save(ref, args.output, name))
        return
    try:
        for ref, name in pairs:
            print(load(ref, args.address, args.namespace, name, args.snapshotter))
    except (LookupError, RuntimeError) as error:
        parser.exit(1, f"{error}\n")


if __name__ == "__main__":
    main()
