"""``./dev image --output DIR``: the DaemonSet's image, built without a container engine and
without a registry, from pinned inputs only:

* Debian 12's python3.11 and the shared libraries it needs (``debian.lock``: name, version and
  SHA256 of each .deb, the dependency closure of ``ROOTS``; ``--update-debian-lock`` rewrites
  it from the archive's current versions);
* the dependencies' wheels (``requirements.lock``, pinned by hash);
* the project's wheel, built from the committed tree of HEAD with the pinned setuptools
  (``build-requirements.lock``) and SOURCE_DATE_EPOCH = the commit's time.

It writes an OCI image archive into DIR (packaging/README.md, "The image") and prints the
image's digest as its last line.  Two builds of one commit give the same digest.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import image_bytecode
import image_debs
import image_oci
import image_wheels
from image_debs import BuildError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEBIAN_LOCK = HERE / "debian.lock"
REQUIREMENTS = HERE / "requirements.lock"
BUILD_REQUIREMENTS = HERE / "build-requirements.lock"
# The interpreter and its standard library; libstdc++6, which manylinux wheels may take from the
# system (protobuf's upb extension does: without it protobuf falls back to pure Python); and
# base-files for /etc/os-release, which is how image scanners tell the distribution (they read
# the package list from /var/lib/dpkg/status).
ROOTS = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "base-files")
# Not followed: package-management tools that only maintainer scripts use (readline-common's
# "dpkg | install-info"), and base-files' "awk" (a virtual package, for its postinst).
EXCLUDE = ("dpkg", "awk")
# Kept of /usr/share/doc: the copyright files; the rest of the documentation is dropped.
DROPPED = ("usr/share/man", "usr/share/info", "usr/share/lintian", "usr/share/bug")
NAME = "docker.io/library/nri-cpuplugin"
ENTRYPOINT = ["nri-cpuplugin"]
CMD = ["run"]
ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
]


def git(*args: str) -> str:
    return image_debs.run(["git", "-C", str(REPO), *args], f"git {' '.join(args)}").strip()


def project(revision: str) -> dict[str, str]:
    meta = tomllib.loads(git("show", f"{revision}:pyproject.toml"))["project"]
    return {k: meta[k] for k in ("name", "version", "description", "license")}


def image_config(meta: dict[str, str], revision: str, source_url: str | None) -> dict[str, object]:
    labels = {
        "org.opencontainers.image.title": meta["name"],
        "org.opencontainers.image.description": meta["description"],
        "org.opencontainers.image.version": meta["version"],
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.licenses": meta["license"],
    }
    if source_url:
        labels["org.opencontainers.image.source"] = source_url
    return {
        "Entrypoint": ENTRYPOINT,
        "Cmd": CMD,
        "Env": ENV,
        "WorkingDir": "/",
        "User": "0",
        "Labels": labels,
    }


def debian_root(root: Path, work: Path, scratch: Path) -> None:
    """The base layer's tree: the locked packages, trimmed, merged-/usr, with dpkg's status."""
    apt = image_debs.PrivateApt(work)
    stanzas = []
    for deb in image_debs.read_lock(DEBIAN_LOCK):
        deb_file = image_debs.fetch(apt, deb, work / "debs")
        image_debs.unpack(deb_file, root, scratch)
        stanzas.append(image_debs.status_stanza(deb_file))
    for path in DROPPED:
        shutil.rmtree(root / path, ignore_errors=True)
    for doc in sorted((root / "usr/share/doc").iterdir()):
        for item in doc.iterdir():
            if item.name != "copyright":
                shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
    image_debs.merged_usr_links(root)
    (root / "var/lib/dpkg").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/dpkg/status").write_text("\n".join(stanzas))
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/:/usr/sbin/nologin\n"
    )
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    for mount_point in ("dev", "proc", "sys", "run", "tmp", "root", "var/tmp"):
        (root / mount_point).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "var/tmp").chmod(0o1777)


@contextlib.contextmanager
def locked(work: Path) -> Iterator[None]:
    """One build at a time per work directory: builds share its caches."""
    work.mkdir(parents=True, exist_ok=True)
    with (work / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(output: Path, work: Path, source_url: str | None, rev: str = "HEAD") -> str:
    revision = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    epoch = int(git("log", "-1", "--format=%ct", revision))
    meta = project(revision)
    if rev == "HEAD" and git("status", "--porcelain", "--untracked-files=no"):
        print(f"image: uncommitted changes are not in the image (built from {revision[:12]})",
              file=sys.stderr)  # fmt: skip
    with locked(work):
        tmp = work / f"tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            roots = {n: tmp / n for n in ("debian", "dependencies", "project")}
            for root in roots.values():
                root.mkdir(parents=True)
            debian_root(roots["debian"], work, tmp / "scratch")
            for wheel in image_wheels.download(REQUIREMENTS, work / "wheels"):
                image_wheels.install(wheel, roots["dependencies"])
            backend = image_wheels.build_backend(BUILD_REQUIREMENTS, work / "build-backend")
            own = image_wheels.project_wheel(REPO, revision, backend, tmp / "wheel", epoch)
            image_wheels.install(own, roots["project"])
            python = roots["debian"]
            image_bytecode.compile_tree(python, python, ["usr/lib/python3.11"])
            for tree in (roots["dependencies"], roots["project"]):
                image_bytecode.compile_tree(python, tree, [image_wheels.SITE])
            layers = [
                image_oci.write_layer(roots["debian"], tmp / "debian.tar", epoch,
                                      "Debian 12 packages: packaging/image/debian.lock"),
                image_oci.write_layer(roots["dependencies"], tmp / "dependencies.tar", epoch,
                                      "PyPI wheels: packaging/image/requirements.lock"),
                image_oci.write_layer(roots["project"], tmp / "project.tar", epoch,
                                      f"{meta['name']} {meta['version']} ({revision})"),
            ]  # fmt: skip
            output.mkdir(parents=True, exist_ok=True)
            archive = output / f"{meta['name']}-{meta['version']}.oci.tar"
            config = image_config(meta, revision, source_url)
            digest = image_oci.write_archive(
                archive, layers, config, f"{NAME}:{meta['version']}", epoch
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for layer in layers:
        print(f"layer {layer.digest} {layer.size} bytes: {layer.created_by}")
    print(f"archive {archive} ({archive.stat().st_size} bytes), image {NAME}:{meta['version']}")
    return digest


def update_debian_lock(work: Path) -> None:
    with locked(work):
        apt = image_debs.PrivateApt(work)
        apt.update(force=True)
        debs = image_debs.resolve(apt, ROOTS, EXCLUDE)
    header = [line for line in DEBIAN_LOCK.read_text().splitlines() if line.startswith("#")]
    DEBIAN_LOCK.write_text("\n".join(header) + "\n" + image_debs.lock_text(debs))
    print(f"{DEBIAN_LOCK}: {len(debs)} packages")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="directory the archive is written into")
    parser.add_argument(
        "--work", type=Path, default=REPO / ".lab/image-build",
        help="work directory, caching downloads between builds (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--source-url", help="org.opencontainers.image.source label's value")
    parser.add_argument(
        "--revision", default="HEAD",
        help="the commit whose project is built (an older release's, say; default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--update-debian-lock", action="store_true",
        help="rewrite debian.lock from the archive's current versions, then stop",
    )  # fmt: skip
    args = parser.parse_args(argv)
    os.umask(0o022)  # directory and file modes must not depend on the caller's umask
    try:
        if args.update_debian_lock:
            update_debian_lock(args.work.absolute())
            return 0
        if args.output is None:
            parser.error("--output DIR is required (where the image archive is written)")
        digest = build(args.output.absolute(), args.work.absolute(), args.source_url, args.revision)
    except BuildError as error:
        print(f"image: {error}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        print(f"image: {error}", file=sys.stderr)
        return 1
    print(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
