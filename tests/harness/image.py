"""A registry-free busybox image for containerd: rootfs and OCI image-layout tarball.

Nothing is pulled: the root filesystem is Debian's static busybox plus one symlink per applet,
packed as a single uncompressed layer.  The layer tar is reproducible (sorted entries, uid/gid 0,
mtime 0, PAX format), so its digest - and therefore every image digest - is the same on every
machine and every run.  Being uncompressed, the layer digest doubles as its ``diff_id``.

``index.json`` carries ``io.containerd.image.name`` annotations, so ``ctr images import`` names
the images itself (no tag step).  Both images share the layer; they differ only in their command.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from . import debs
from .packages import BUSYBOX_STATIC

PAUSE_IMAGE = "lab.invalid/pause:1"
BUSYBOX_IMAGE = "lab.invalid/busybox:1"

# Bump when the rootfs or tarball layout produced here changes: it is part of the cache key.
FORMAT = 1

# The sandbox ("pause") container: waits without polling and exits 0 on TERM/INT like the real
# pause binary.  Pods use a private PID namespace per container, so this shell is PID 1 there and
# needs the explicit trap to react to TERM at all.
PAUSE_CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; sleep infinity & wait"]
IMAGES: Mapping[str, Sequence[str]] = {PAUSE_IMAGE: PAUSE_CMD, BUSYBOX_IMAGE: ["/bin/sh"]}

_MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
_MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
_MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"


def _cache_dir(lab: Path) -> Path:
    key = hashlib.sha256(f"{BUSYBOX_STATIC.sha256}:{FORMAT}".encode()).hexdigest()[:12]
    return lab / "image" / key


def rootfs(lab: Path = debs.LAB) -> Path:
    """The busybox root filesystem directory (built once); also usable as a runc bundle root."""
    return _build(lab) / "rootfs"


def images_tar(lab: Path = debs.LAB) -> Path:
    """The OCI image-layout tarball holding ``PAUSE_IMAGE`` and ``BUSYBOX_IMAGE`` (built once)."""
    return _build(lab) / "images.tar"


def _build(lab: Path) -> Path:
    target = _cache_dir(lab)
    if (target / ".done").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".lock").open("w") as lock:  # parallel workers share the cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".done").exists():
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _make_rootfs(debs.unpack(BUSYBOX_STATIC, lab) / "bin/busybox", partial / "rootfs")
        (partial / "images.tar").write_bytes(oci_layout_tar(partial / "rootfs", IMAGES))
        (partial / ".done").touch()
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    return target


def _make_rootfs(busybox: Path, root: Path) -> None:
    for d in ("bin", "dev", "etc", "proc", "root", "run", "sys", "tmp", "var"):
        (root / d).mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    shutil.copy2(busybox, root / "bin/busybox")
    (root / "bin/busybox").chmod(0o755)
    # Every applet the binary has, all in /bin: the image's PATH is just /bin.
    listed = subprocess.run(
        [str(busybox), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in sorted(set(listed) - {"busybox"}):
        os.symlink("busybox", root / "bin" / applet)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")


def _layer_tar(root: Path) -> bytes:
    """One reproducible layer: everything below ``root``, sorted, owned by root, at mtime 0."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            # Modes from the disk depend on the umask; fix them so the digest never varies.
            if info.isdir():
                info.mode = 0o1777 if info.mode & 0o1000 else 0o755
            elif info.isreg():
                info.mode = 0o755 if info.mode & 0o100 else 0o644
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def _blob(data: bytes, media_type: str) -> tuple[dict[str, object], str]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return {"mediaType": media_type, "digest": digest, "size": len(data)}, digest


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def oci_layout_tar(root: Path, images: Mapping[str, Sequence[str]]) -> bytes:
    """An OCI image-layout tarball with one image per ``name -> command`` over one shared layer."""
    layer = _layer_tar(root)
    layer_desc, layer_digest = _blob(layer, _MEDIA_LAYER)
    blobs: dict[str, bytes] = {layer_digest: layer}
    manifests = []
    for name, cmd in images.items():
        config = _json(
            {
                "created": "1970-01-01T00:00:00Z",
                "architecture": "amd64",
                "os": "linux",
                "config": {"Env": ["PATH=/bin"], "Cmd": list(cmd), "WorkingDir": "/"},
                "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
                "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "tests/harness"}],
            }
        )
        config_desc, config_digest = _blob(config, _MEDIA_CONFIG)
        manifest = _json(
            {
                "schemaVersion": 2,
                "mediaType": _MEDIA_MANIFEST,
                "config": config_desc,
                "layers": [layer_desc],
            }
        )
        manifest_desc, manifest_digest = _blob(manifest, _MEDIA_MANIFEST)
        blobs[config_digest] = config
        blobs[manifest_digest] = manifest
        manifests.append(
            {
                **manifest_desc,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rpartition(":")[2],
                },
            }
        )
    files = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": _json(
            {"schemaVersion": 2, "mediaType": _MEDIA_INDEX, "manifests": manifests}
        ),
        **{f"blobs/sha256/{d.removeprefix('sha256:')}": data for d, data in blobs.items()},
    }
    return _archive(files)


def _archive(files: Mapping[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in _entries(files):
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _entries(files: Mapping[str, bytes]) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    # Every ancestor directory gets its own entry, parents first (sorted order gives that).
    dirs = sorted({str(parent) for name in files for parent in Path(name).parents} - {"."})
    for d in dirs:
        info = tarfile.TarInfo(d)
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        yield info, None
    for name in sorted(files):
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(files[name]), 0o644
        yield info, files[name]
