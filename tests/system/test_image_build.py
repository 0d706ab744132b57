"""``./dev image`` (packaging/image/): reproducible, complete, and the archive says what it holds.

* Two builds of one commit give the same digest and the same archive, byte for byte (the second
  reuses the first's download cache: the inputs are the same pinned files either way).
* The archive is an OCI image layout with Docker's manifest.json beside it; every blob matches
  its digest; the config carries the entrypoint, environment and labels the Dockerfile declares.
* The root filesystem is complete: chrooted into it, Debian's python3.11 imports every extension
  module of its standard library and of the wheels (so each shared library they need is there),
  and the console script runs; every Python file has hash-checked bytecode the interpreter uses.
* debian.lock is the dependency closure the recipe says it is (apt's current candidates).

Loading and running the image in containerd and podman: tests/e2e/test_image.py.
"""

from __future__ import annotations

import filecmp
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import product_image
import pytest

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


@pytest.fixture(scope="module")
def image() -> product_image.Built:
    return product_image.cached()


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def blob(files: dict[str, bytes], digest: str) -> bytes:
    return files[f"blobs/sha256/{digest.removeprefix('sha256:')}"]


def head(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(product_image.REPO), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_two_builds_of_one_commit_give_the_same_digest(image, tmp_path: Path) -> None:
    again = product_image.build(tmp_path / "again")
    assert again.digest == image.digest
    assert filecmp.cmp(again.archive, image.archive, shallow=False)


def test_archive_is_an_oci_layout_with_a_docker_manifest(image) -> None:
    files = members(image.archive)
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rpartition("/")[2]
    [entry] = json.loads(files["index.json"])["manifests"]
    assert entry["digest"] == image.digest and entry["mediaType"] == MEDIA_MANIFEST
    manifest = json.loads(blob(files, image.digest))
    config = json.loads(blob(files, manifest["config"]["digest"]))
    layers = [layer["digest"] for layer in manifest["layers"]]
    assert config["rootfs"]["diff_ids"] == layers  # uncompressed: digest = diff_id
    assert len(layers) == 3  # Debian, the dependencies' wheels, the project
    [docker] = json.loads(files["manifest.json"])
    assert docker["Config"] == f"blobs/sha256/{manifest['config']['digest'][7:]}"
    assert docker["Layers"] == [f"blobs/sha256/{d[7:]}" for d in layers]
    recipe = product_image.recipe()
    assert config["config"]["Entrypoint"] == recipe.ENTRYPOINT == ["nri-cpuplugin"]
    assert config["config"]["Cmd"] == recipe.CMD == ["run"]
    assert config["config"]["Env"] == recipe.ENV
    labels = config["config"]["Labels"]
    assert labels["org.opencontainers.image.revision"] == head("rev-parse", "HEAD")
    assert (
        entry["annotations"]["org.opencontainers.image.ref.name"]
        == (labels["org.opencontainers.image.version"])
    )
    # Every entry of every layer: root's, at the commit's time, no hard links.
    epoch = int(head("log", "-1", "--format=%ct"))
    for digest in layers:
        with tarfile.open(fileobj=io.BytesIO(blob(files, digest))) as tar:
            for member in tar.getmembers():
                assert (member.uid, member.gid, member.mtime) == (0, 0, epoch), member.name
                assert not member.islnk(), member.name


@pytest.fixture(scope="module")
def root(image, tmp_path_factory) -> Path:
    """The image's root filesystem: its layers unpacked in order (they hold no whiteouts)."""
    files = members(image.archive)
    manifest = json.loads(blob(files, image.digest))
    target = tmp_path_factory.mktemp("image") / "root"
    target.mkdir()
    for layer in manifest["layers"]:
        with tarfile.open(fileobj=io.BytesIO(blob(files, layer["digest"]))) as tar:
            tar.extractall(target, filter="tar")
    return target


def test_python_finds_every_library_its_extension_modules_need(root: Path) -> None:
    dynload = root / "usr/lib/python3.11/lib-dynload"
    stdlib = sorted(p.name.split(".")[0] for p in dynload.glob("*.so"))
    site = root / "usr/local/lib/python3.11/dist-packages"
    wheels = sorted(
        ".".join(p.relative_to(site).with_suffix("").with_suffix("").parts)
        for p in site.rglob("*.so")
    )
    assert "_ssl" in stdlib and "_ctypes" in stdlib and wheels  # what the lists must hold
    code = "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)\n"
    result = subprocess.run(
        [CHROOT, str(root), "/usr/bin/python3.11", "-c", code, *stdlib, *wheels],
        capture_output=True, text=True, check=False, env={"PATH": "/usr/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    # protobuf's C extension (it needs libstdc++), not its pure-Python fallback
    which = "from google.protobuf.internal import api_implementation as a; print(a.Type())"
    result = subprocess.run(
        [CHROOT, str(root), "/usr/bin/python3.11", "-c", which],
        capture_output=True, text=True, check=False, env={"PATH": "/usr/bin"},
    )  # fmt: skip
    assert result.stdout.strip() == "upb", result.stderr


def test_every_python_file_has_bytecode_the_interpreter_accepts(root: Path) -> None:
    trees = [root / "usr/lib/python3.11", root / "usr/local/lib/python3.11/dist-packages"]
    sources = [py for tree in trees for py in tree.rglob("*.py")]
    assert len(sources) > 500
    for py in sources:
        pyc = py.parent / "__pycache__" / f"{py.stem}.cpython-311.pyc"
        flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
        assert flags == 0b11, f"{pyc}: not hash-checked bytecode"  # no mtime in it
    # Imported from the .pyc files, none found stale (the interpreter's own verdict).
    result = subprocess.run(
        [CHROOT, str(root), "/usr/bin/python3.11", "-v", "-c", "import nri_cpuplugin.cli"],
        capture_output=True, text=True, check=False, env={"PATH": "/usr/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "nri_cpuplugin/__pycache__/cli.cpython-311.pyc matches" in result.stderr
    assert "stale" not in result.stderr


def test_console_script_runs_in_the_image_root(root: Path) -> None:
    result = subprocess.run(
        [CHROOT, str(root), "nri-cpuplugin", "--help"],
        capture_output=True, text=True, check=False, env={"PATH": "/usr/local/bin:/usr/bin"},
    )  # fmt: skip
    assert result.returncode == 0 and "topology" in result.stdout, result.stderr
    status = (root / "var/lib/dpkg/status").read_text()
    installed = {line.split()[1] for line in status.splitlines() if line.startswith("Package: ")}
    recipe = product_image.recipe()
    locked = recipe.image_debs.read_lock(recipe.DEBIAN_LOCK)
    assert installed == {deb.name for deb in locked}
    assert "ID=debian" in (root / "etc/os-release").read_text()


def test_debian_lock_is_the_closure_of_the_roots() -> None:
    recipe = product_image.recipe()
    apt = recipe.image_debs.PrivateApt(product_image.LAB / "image-build")
    resolved = recipe.image_debs.resolve(apt, recipe.ROOTS, recipe.EXCLUDE)
    locked = recipe.image_debs.read_lock(recipe.DEBIAN_LOCK)
    assert [d.name for d in resolved] == [d.name for d in locked]
