"""Runtime builds that no Debian suite carries, as pinned tarballs from the shared runtimes
directory next to the checkout (``<checkout>/../shared/runtimes/<kind>/``).

Each tarball is pinned by SHA256, and so is every file the tests run from it: the tarball is
copied (hard-linked where possible) into ``<lab>/tarballs/`` and checked there, and the files
taken out of it are checked again after extraction, so neither a changed tarball nor a file
altered in the lab can change what a test runs.  Only the files a test needs are extracted,
as regular files: a source tarball holds thousands of files and the tests read three.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .debs import LAB, REPO


def _shared_runtimes() -> Path:
    """The shared directory is a sibling of the checkout on these machines.  A fresh clone
    elsewhere (CI's ``git clone . "$d/p"``) finds it beside the checkout it was cloned from,
    when that is a local directory (the tarballs are pinned by SHA256 either way).  A copy
    of the checkout elsewhere (tests/e2e/test_checkout_paths.py) gets the tarballs seeded
    into its lab instead.  ``NRI_SHARED_RUNTIMES`` names the directory outright (a git
    worktree has neither a sibling nor an origin)."""
    if named := os.environ.get("NRI_SHARED_RUNTIMES"):
        return Path(named)
    beside = REPO.parent / "shared" / "runtimes"
    if beside.is_dir():
        return beside
    try:
        origin = subprocess.run(
            ["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
            capture_output=True, text=True, check=False, timeout=10,
        ).stdout.strip()  # fmt: skip
    except OSError:
        return beside
    if origin.startswith("/") and (Path(origin).parent / "shared" / "runtimes").is_dir():
        return Path(origin).parent / "shared" / "runtimes"
    return beside


SHARED = _shared_runtimes()


class TarballError(RuntimeError):
    """A tarball or a file in it is missing or does not match its pin; the message says which."""


@dataclass(frozen=True)
class Tarball:
    """``filename`` in ``<shared>/<kind>/``; ``files`` maps paths inside the tarball (without
    its top directory, if it has one) to their pinned SHA256; ``top`` is that directory."""

    kind: str
    filename: str
    sha256: str
    files: Mapping[str, str] = field(default_factory=dict)
    top: str = ""

    @property
    def stem(self) -> str:
        return self.filename.removesuffix(".tar.gz")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(tarball: Tarball, lab: Path = LAB) -> Path:
    """The verified tarball in ``<lab>/tarballs/`` (copied from the shared directory once)."""
    target_dir = lab / "tarballs"
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / tarball.filename
    with (lab / "tarballs.lock").open("w") as lock:  # parallel sessions share the lab
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            source = SHARED / tarball.kind / tarball.filename
            if not source.is_file():
                raise TarballError(
                    f"{tarball.filename} is neither in {target_dir} nor in {source.parent} "
                    "(the shared runtimes directory next to the checkout)"
                )
            partial = target.with_name(target.name + ".partial")
            partial.unlink(missing_ok=True)
            try:
                os.link(source, partial)
            except OSError:  # another filesystem, or links refused
                shutil.copyfile(source, partial)
            partial.rename(target)
        actual = _sha256(target)
        if actual != tarball.sha256:
            target.rename(target.with_name(target.name + ".rejected"))
            raise TarballError(
                f"{tarball.filename}: SHA256 {actual} does not match the pinned {tarball.sha256}"
            )
    return target


def unpack(tarball: Tarball, lab: Path = LAB) -> Path:
    """The pinned ``files`` of ``tarball``, extracted once into ``<lab>/pkgs/<stem>/`` and
    checked against their pins every time (a few hundred MB/s: milliseconds per binary)."""
    root = lab / "pkgs" / tarball.stem
    done = root / ".unpacked"
    if not done.exists():
        source = fetch(tarball, lab)
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        _extract(source, tarball, partial)
        shutil.rmtree(root, ignore_errors=True)
        partial.rename(root)
        done.touch()
    for name, pinned in tarball.files.items():
        actual = _sha256(root / name)
        if actual != pinned:
            raise TarballError(
                f"{tarball.filename}: {name} has SHA256 {actual}, not the pinned {pinned}"
            )
    return root


def _extract(source: Path, tarball: Tarball, into: Path) -> None:
    prefix = f"{tarball.top}/" if tarball.top else ""
    wanted = {prefix + name: name for name in tarball.files}
    with tarfile.open(source, "r:gz") as archive:
        for member in archive:
            name = wanted.pop(member.name.removeprefix("./"), None)
            if name is None:
                continue
            if not member.isfile():  # a link or device where a file was pinned: refuse
                raise TarballError(f"{tarball.filename}: {member.name} is not a regular file")
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            reader = archive.extractfile(member)
            assert reader is not None
            with reader, target.open("wb") as out:
                shutil.copyfileobj(reader, out)
            target.chmod(0o755 if member.mode & 0o111 else 0o644)
            if not wanted:
                break
    if wanted:
        raise TarballError(f"{tarball.filename} lacks {sorted(wanted)}")
