"""The pieces of ``./dev image`` (packaging/image/) that need no network: the lock parser and the
dependency walk, the wheel installer, and the layer writer's reproducibility.  The whole build,
twice, is tests/system/test_image_build.py."""

from __future__ import annotations

import os
import tarfile
import zipfile
from pathlib import Path

import product_image
import pytest


@pytest.fixture(scope="module")
def recipe():
    return product_image.recipe()


def test_a_malformed_lock_line_is_refused_with_its_place(recipe, tmp_path: Path) -> None:
    lock = tmp_path / "debian.lock"
    lock.write_text("# comment\nlibc6 2.36-9 amd64\n")
    with pytest.raises(recipe.image_debs.BuildError, match=r"debian.lock:2: expected 'name"):
        recipe.image_debs.read_lock(lock)
    lock.write_text("libc6 2.36-9 amd64 " + "a" * 64 + "  # pinned\n")
    [deb] = recipe.image_debs.read_lock(lock)
    assert deb.filename == "libc6_2.36-9_amd64.deb"
    epoch = recipe.image_debs.Deb("libcrypt1", "1:4.4.33-2", "amd64", "0" * 64)
    assert epoch.filename == "libcrypt1_1%3a4.4.33-2_amd64.deb"  # as apt-get download names it


class FakeApt:
    """apt-cache's answers for a small archive (the walk's input, not apt itself)."""

    def __init__(self, packages: dict[str, str]) -> None:
        self.packages = packages

    def show(self, names):
        return {
            n: {"Version": "1", "Architecture": "amd64", "SHA256": "0" * 64, "Depends": d}
            for n, d in self.packages.items()
            if n in names
        }


def test_the_dependency_walk_takes_first_alternatives_without_versions(recipe) -> None:
    field = "libc6 (>= 2.34), dpkg (>= 1.15.4) | install-info, python3:any, zlib1g"
    leaves = {name: "" for name in ("libc6", "dpkg", "python3", "zlib1g", "install-info")}
    apt = FakeApt({"app": field, **leaves})
    names = [d.name for d in recipe.image_debs.resolve(apt, ["app"], [])]
    assert names == ["app", "dpkg", "libc6", "python3", "zlib1g"]  # no install-info


def test_the_closure_follows_depends_and_stops_at_exclusions(recipe) -> None:
    apt = FakeApt({"python": "libc, libssl", "libssl": "libc", "libc": "", "rl": "dpkg | info"})
    names = [d.name for d in recipe.image_debs.resolve(apt, ["python", "rl"], ["dpkg"])]
    assert names == ["libc", "libssl", "python", "rl"]
    with pytest.raises(recipe.image_debs.BuildError, match=r"not in Debian bookworm: \['info'\]"):
        recipe.image_debs.resolve(FakeApt({"rl": "info"}), ["rl"], [])


def make_wheel(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in members.items():
            wheel.writestr(name, text)
    return path


def test_a_wheel_installs_where_pip_puts_it_for_debians_python(recipe, tmp_path: Path) -> None:
    wheel = make_wheel(
        tmp_path / "demo-1.0-py3-none-any.whl",
        {
            "demo/__init__.py": "",
            "demo-1.0.dist-info/METADATA": "Name: demo\n",
            "demo-1.0.dist-info/entry_points.txt": "[console_scripts]\ndemo-run = demo.cli:main\n",
            "demo-1.0.data/scripts/helper": "#!/bin/sh\n",
            "demo-1.0.data/platlib/demo_ext.py": "",
        },
    )
    root = tmp_path / "root"
    recipe.image_wheels.install(wheel, root)
    site = root / "usr/local/lib/python3.11/dist-packages"
    assert (site / "demo/__init__.py").is_file() and (site / "demo_ext.py").is_file()
    assert (site / "demo-1.0.dist-info/METADATA").is_file()
    assert (root / "usr/local/bin/helper").stat().st_mode & 0o777 == 0o755
    script = root / "usr/local/bin/demo-run"
    assert script.read_text().splitlines() == [
        "#!/usr/bin/python3.11",
        "import sys",
        "from demo.cli import main",
        "sys.exit(main())",
    ]
    assert script.stat().st_mode & 0o777 == 0o755


def test_a_wheel_member_outside_its_tree_is_refused(recipe, tmp_path: Path) -> None:
    wheel = make_wheel(
        tmp_path / "bad-1.0-py3-none-any.whl",
        {"bad-1.0.dist-info/METADATA": "", "../escape.py": ""},
    )
    with pytest.raises(recipe.image_debs.BuildError, match="escapes its directory"):
        recipe.image_wheels.install(wheel, tmp_path / "root")


def tree(root: Path, mtime: int) -> Path:
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/tool").write_text("#!/bin/sh\n")
    (root / "usr/bin/tool").chmod(0o755)
    (root / "usr/bin/same").hardlink_to(root / "usr/bin/tool")
    (root / "bin").symlink_to("usr/bin")
    for path in (root / "usr/bin/tool", root / "usr/bin", root / "usr"):
        os.utime(path, (mtime, mtime))
    return root


def test_a_layer_depends_on_the_files_alone(recipe, tmp_path: Path) -> None:
    """Two trees of the same files with other mtimes on disk, written in another order: the
    same bytes; every entry root's at the given time; a hard link becomes a second file."""
    a = recipe.image_oci.write_layer(tree(tmp_path / "a", 1000), tmp_path / "a.tar", 42, "x")
    b = recipe.image_oci.write_layer(tree(tmp_path / "b", 2000), tmp_path / "b.tar", 42, "x")
    assert a.path.read_bytes() == b.path.read_bytes() and a.digest == b.digest
    with tarfile.open(a.path) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["bin", "usr", "usr/bin", "usr/bin/same", "usr/bin/tool"]
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in members} == {(0, 0, "", "", 42)}
    assert [m.type for m in members][3:] == [tarfile.REGTYPE, tarfile.REGTYPE]
    assert members[0].issym() and members[0].linkname == "usr/bin"


def test_the_archive_names_the_image_for_ctr_podman_and_docker(recipe, tmp_path: Path) -> None:
    layer = recipe.image_oci.write_layer(tree(tmp_path / "a", 1), tmp_path / "l.tar", 0, "x")
    out = tmp_path / "image.tar"
    name = "docker.io/library/demo:1.2"
    digest = recipe.image_oci.write_archive(out, [layer], {"Cmd": ["run"]}, name, 0)
    again = recipe.image_oci.write_archive(
        tmp_path / "again.tar", [layer], {"Cmd": ["run"]}, name, 0
    )
    assert digest == again and out.read_bytes() == (tmp_path / "again.tar").read_bytes()
    with tarfile.open(out) as tar:
        index = tar.extractfile("index.json").read().decode()
        docker = tar.extractfile("manifest.json").read().decode()
        assert tar.getnames()[:2] == ["blobs", "blobs/sha256"]
    assert f'"io.containerd.image.name":"{name}"' in index
    assert '"org.opencontainers.image.ref.name":"1.2"' in index and digest in index
    assert '"RepoTags":["demo:1.2"]' in docker
