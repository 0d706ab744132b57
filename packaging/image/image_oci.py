"""Reproducible layers and the image archive: an OCI image layout in a tar, with Docker's
``manifest.json`` beside it, so ``ctr images import``, ``podman load`` and ``docker load`` all
take it.

Every byte is a function of the inputs: entries sorted by path, owned by 0:0 with no user or
group names, every mtime the commit's time (SOURCE_DATE_EPOCH), modes from the unpacked
packages, no access or change times, no hard links.  Layers are uncompressed tars, so a layer's
digest is its ``diff_id`` and no compressor's version can change a digest; a registry push may
compress them (``skopeo copy --dest-compress``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"


@dataclass(frozen=True)
class Layer:
    """One layer's tar (``path`` on disk), its digest and what built it (the history entry)."""

    path: Path
    digest: str
    size: int
    created_by: str


def timestamp(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _walk(root: Path) -> Iterator[Path]:
    """Every path below ``root``, sorted by its path name (a directory before its contents)."""
    yield from sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix())


def _info(path: Path, name: str, epoch: int) -> tarfile.TarInfo:
    st = path.lstat()
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = epoch
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        info.size = st.st_size
    else:
        raise ValueError(f"{path}: only directories, files and symbolic links go into a layer")
    return info


def write_layer(root: Path, out: Path, epoch: int, created_by: str) -> Layer:
    """Everything below ``root`` as one layer tar at ``out``."""
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(root):
            info = _info(path, path.relative_to(root).as_posix(), epoch)
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    digest = hashlib.sha256()
    with out.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return Layer(out, "sha256:" + digest.hexdigest(), out.stat().st_size, created_by)


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, digest: str, size: int) -> dict[str, object]:
    return {"mediaType": media_type, "digest": digest, "size": size}


def image_config(
    layers: Sequence[Layer], config: Mapping[str, object], epoch: int
) -> dict[str, object]:
    created = timestamp(epoch)
    return {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
        "history": [{"created": created, "created_by": layer.created_by} for layer in layers],
    }


def write_archive(
    out: Path, layers: Sequence[Layer], config: Mapping[str, object], name: str, epoch: int
) -> str:
    """The image archive at ``out``; returns the manifest's digest (the image's digest)."""
    config_blob = _json(image_config(layers, config, epoch))
    config_digest = "sha256:" + hashlib.sha256(config_blob).hexdigest()
    layer_descs = [_descriptor(MEDIA_LAYER, layer.digest, layer.size) for layer in layers]
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _descriptor(MEDIA_CONFIG, config_digest, len(config_blob)),
            "layers": layer_descs,
        }
    )
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    repository, _, tag = name.rpartition(":")
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                **_descriptor(MEDIA_MANIFEST, manifest_digest, len(manifest)),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    # ctr names the image from this one, podman from the next.
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    blob = "blobs/sha256/{}".format
    docker_manifest = [
        {
            "Config": blob(config_digest.removeprefix("sha256:")),
            "RepoTags": [f"{repository.removeprefix('docker.io/library/')}:{tag}"],
            "Layers": [blob(str(d["digest"]).removeprefix("sha256:")) for d in layer_descs],
        }
    ]
    small = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": _json(index),
        "manifest.json": _json(docker_manifest),
        blob(config_digest.removeprefix("sha256:")): config_blob,
        blob(manifest_digest.removeprefix("sha256:")): manifest,
    }
    big = {blob(layer.digest.removeprefix("sha256:")): layer.path for layer in layers}
    _write_tar(out, small, big, epoch)
    return manifest_digest


def _write_tar(out: Path, small: Mapping[str, bytes], big: Mapping[str, Path], epoch: int) -> None:
    names = sorted({*small, *big})
    dirs = sorted({p.as_posix() for n in names for p in Path(n).parents} - {"."})
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            tar.addfile(info)
        for name in names:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = 0o644, epoch
            if name in small:
                info.size = len(small[name])
                tar.addfile(info, io.BytesIO(small[name]))
            else:
                info.size = big[name].stat().st_size
                with big[name].open("rb") as f:
                    tar.addfile(info, f)
