"""One-file OCI images, written without a registry or an image builder.

Nothing can be pulled here, so the real node's pause image and the tests' probe image
are a static Go binary each, wrapped by ``write_image`` into an OCI image-layout
archive that ``ctr images import`` reads. The archive is byte-for-byte the same for the
same binary (fixed timestamps and owners), so its digest names its content.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
# ctr names the imported image after this annotation (the OCI one holds only a tag).
CONTAINERD_NAME = "io.containerd.image.name"


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": len(self.data),
            **extra,
        }


def _json_blob(media_type: str, obj: dict[str, Any]) -> Blob:
    return Blob(media_type, json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    tar.addfile(info, io.BytesIO(data))


def _layer(binary: Path, path_in_image: str) -> Blob:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_member(tar, path_in_image.lstrip("/"), binary.read_bytes(), mode=0o755)
    return Blob(LAYER_TYPE, buf.getvalue())


def image_blobs(
    binary: Path, ref: str, argv: list[str], stop_signal: str | None = None
) -> tuple[Blob, list[Blob]]:
    """The manifest and every blob of an image whose only file is `binary`, run as `argv`
    (argv[0] is where the binary lies in the image), stopped with `stop_signal` (the
    runtime's default, SIGTERM, when None)."""
    layer = _layer(binary, argv[0])
    run = {"Entrypoint": argv, "Env": ["PATH=/"]}
    if stop_signal:
        run["StopSignal"] = stop_signal
    config = _json_blob(
        CONFIG_TYPE,
        {
            "architecture": "amd64",
            "os": "linux",
            "config": run,
            "rootfs": {"type": "layers", "diff_ids": [layer.digest]},
        },
    )
    manifest = _json_blob(
        MANIFEST_TYPE,
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": config.descriptor(),
            "layers": [layer.descriptor()],
            "annotations": {CONTAINERD_NAME: ref},
        },
    )
    return manifest, [layer, config, manifest]


def write_image(
    binary: Path, ref: str, argv: list[str], out: Path, stop_signal: str | None = None
) -> str:
    """Write an OCI image-layout archive of `binary` named `ref` to `out` (only when its
    content changed); returns the manifest's digest."""
    manifest, blobs = image_blobs(binary, ref, argv, stop_signal)
    index = _json_blob(
        INDEX_TYPE,
        {
            "schemaVersion": 2,
            "mediaType": INDEX_TYPE,
            "manifests": [
                manifest.descriptor(
                    platform={"architecture": "amd64", "os": "linux"},
                    annotations={
                        CONTAINERD_NAME: ref,
                        "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1],
                    },
                )
            ],
        },
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_member(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _tar_member(tar, "index.json", index.data)
        for blob in blobs:
            _tar_member(tar, f"blobs/sha256/{blob.digest.removeprefix('sha256:')}", blob.data)
    data = buf.getvalue()
    if not out.is_file() or out.read_bytes() != data:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    return manifest.digest


def archive_identity(archive: Path) -> str:
    """A digest of what an image archive holds, read from its table of contents alone:
    index.json (OCI layout) or manifest.json (docker save), both of which name every
    blob by its digest. Hashing the whole archive would cost seconds per gigabyte."""
    with tarfile.open(archive) as tar:
        for name in ("index.json", "manifest.json"):
            try:
                member = tar.extractfile(name)
            except KeyError:
                continue
            if member is not None:
                return "sha256:" + hashlib.sha256(member.read()).hexdigest()
    raise ValueError(f"{archive} is neither an OCI image layout nor a docker archive")
