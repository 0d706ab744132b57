"""The image's Debian 12 packages: resolved, fetched by SHA256 and unpacked, without touching the
machine's apt configuration.

apt runs with a private sources.list (bookworm main only, from the mirror the machine's own apt
sources name), lists directory and cache under the work directory, so the system's sources, pins
and installed packages stay as they were.  Every .deb is checked against the SHA256 pinned in
``debian.lock`` before ``dpkg-deb -x`` unpacks it, so a changed archive cannot change the image.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
SUITE = "bookworm"
# Debian 12 is merged-/usr: these top-level directories are links into /usr, as in its images.
MERGED = ("bin", "lib", "lib64", "sbin")


class BuildError(RuntimeError):
    """A step of the build failed; the message says which and what to do."""


@dataclass(frozen=True)
class Deb:
    name: str
    version: str
    arch: str
    sha256: str

    @property
    def filename(self) -> str:
        # apt encodes the ':' of an epoch as %3a in file names.
        return f"{self.name}_{self.version.replace(':', '%3a')}_{self.arch}.deb"


def read_lock(path: Path) -> list[Deb]:
    """``name version arch sha256`` per line; '#' starts a comment."""
    debs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 4 or not re.fullmatch(r"[0-9a-f]{64}", words[3]):
            raise BuildError(f"{path}:{number}: expected 'name version arch sha256', got {line!r}")
        debs.append(Deb(*words))
    return debs


def lock_text(debs: Iterable[Deb]) -> str:
    rows = sorted(debs, key=lambda d: d.name)
    return "".join(f"{d.name} {d.version} {d.arch} {d.sha256}\n" for d in rows)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    try:
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise BuildError(f"{what}: {cmd[0]} is not installed (a Debian machine has it)") from None
    if result.returncode:
        raise BuildError(
            f"{what} failed (exit {result.returncode}): {result.stderr.strip()[-800:]}"
        )
    return result.stdout


def mirror() -> str:
    """The machine's Debian mirror (its bookworm stanza): the one this machine may reach."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for stanza in sources.read_text().split("\n\n"):
            if re.search(r"^Suites:.*\bbookworm\b(?!-)", stanza, re.M) and (
                match := re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            ):
                return match.group(1)
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = [p for p in line.split() if not p.startswith("[")]
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                return parts[1]
    raise BuildError(
        "no bookworm source in /etc/apt (sources.list or sources.list.d/debian.sources): "
        "the build fetches Debian 12's packages from the mirror named there"
    )


class PrivateApt:
    """apt-get/apt-cache over a private bookworm-only configuration under ``work``."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "apt"
        self._ready = False

    def options(self) -> list[str]:
        return [
            f"-o=Dir::Etc::SourceList={self.dir / 'sources.list'}",
            "-o=Dir::Etc::SourceParts=/nonexistent",
            f"-o=Dir::State::Lists={self.dir / 'lists'}",
            f"-o=Dir::Cache={self.dir / 'cache'}",
            "-o=APT::Get::List-Cleanup=0",
            "-o=Debug::NoLocking=1",
        ]

    def update(self, force: bool = False) -> None:
        stamp = self.dir / "updated"
        if self._ready and not force:
            return
        (self.dir / "lists/partial").mkdir(parents=True, exist_ok=True)
        (self.dir / "cache/archives/partial").mkdir(parents=True, exist_ok=True)
        (self.dir / "sources.list").write_text(
            f"deb [signed-by={KEYRING}] {mirror()} {SUITE} main\n"
        )
        if force or not stamp.exists():
            run(["apt-get", *self.options(), "update", "-qq"], "apt-get update (private lists)")
            stamp.touch()
        self._ready = True

    def show(self, names: Iterable[str]) -> dict[str, dict[str, str]]:
        """Each package's candidate version's control fields, by name (one apt-cache call)."""
        self.update()
        names = sorted(set(names))
        text = run(
            ["apt-cache", *self.options(), "show", "--no-all-versions", *names],
            f"apt-cache show {' '.join(names)}",
        )
        found: dict[str, dict[str, str]] = {}
        for stanza in text.split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if line and not line[0].isspace() and ":" in line:
                    key, _, value = line.partition(":")
                    fields[key] = value.strip()
            if "Package" in fields:
                found[fields["Package"]] = fields
        return found

    def download(self, deb: Deb, into: Path) -> None:
        cmd = ["apt-get", *self.options(), "download", f"{deb.name}={deb.version}"]
        self.update()
        try:
            run(cmd, f"apt-get download {deb.name}={deb.version}", cwd=into)
        except BuildError:
            # The lists may be older than the pin (a point release since): refresh once, retry.
            self.update(force=True)
            try:
                run(cmd, f"apt-get download {deb.name}={deb.version}", cwd=into)
            except BuildError as error:
                raise BuildError(
                    f"{error}\nThe mirror no longer has {deb.name} {deb.version} (Debian keeps "
                    "only a suite's current versions): run `python packaging/image/image_build.py "
                    "--update-debian-lock`, review the change to packaging/image/debian.lock and "
                    "commit it"
                ) from None


def _first_alternatives(field: str) -> list[str]:
    """Package names of a Depends-style field, the first of each 'a | b' alternative."""
    names = []
    for clause in filter(None, (c.strip() for c in field.split(","))):
        first = clause.split("|")[0].strip()
        names.append(re.split(r"[\s(:]", first, maxsplit=1)[0])
    return names


def resolve(apt: PrivateApt, roots: Iterable[str], exclude: Iterable[str]) -> list[Deb]:
    """The closure of ``roots`` over Pre-Depends and Depends (first alternatives), without
    ``exclude`` (and what only they pull in), as candidate versions with their archive SHA256."""
    skip, found = set(exclude), {}
    todo = set(roots) - skip
    while todo:
        shown = apt.show(todo)
        if missing := todo - shown.keys():
            raise BuildError(f"not in Debian {SUITE}: {sorted(missing)} (virtual? exclude it)")
        todo = set()
        for name, fields in shown.items():
            found[name] = Deb(name, fields["Version"], fields["Architecture"], fields["SHA256"])
            for key in ("Pre-Depends", "Depends"):
                todo.update(_first_alternatives(fields.get(key, "")))
        todo -= skip | found.keys()
    return sorted(found.values(), key=lambda d: d.name)


def fetch(apt: PrivateApt, deb: Deb, cache: Path) -> Path:
    """The verified .deb, downloaded once into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / deb.filename
    if not path.exists():
        apt.download(deb, cache)
    actual = sha256_of(path)
    if actual != deb.sha256:
        path.rename(path.with_name(path.name + ".rejected"))
        raise BuildError(
            f"{deb.filename}: SHA256 {actual} does not match the pinned {deb.sha256} in "
            "packaging/image/debian.lock: check the package and update the pin deliberately"
        )
    return path


def unpack(deb_file: Path, root: Path, scratch: Path) -> None:
    """``dpkg-deb -x`` into ``scratch``, then merge into ``root`` with /bin, /lib, ... in /usr."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    run(["dpkg-deb", "-x", str(deb_file), str(scratch)], f"dpkg-deb -x {deb_file.name}")
    for top in sorted(scratch.iterdir()):
        target = root / "usr" / top.name if top.name in MERGED else root / top.name
        _merge(top, target)
    shutil.rmtree(scratch)


def _merge(source: Path, target: Path) -> None:
    if source.is_dir() and not source.is_symlink():
        target.mkdir(parents=True, exist_ok=True)
        for child in sorted(source.iterdir()):
            _merge(child, target / child.name)
        return
    if target.exists() or target.is_symlink():
        same = (
            source.is_symlink() and target.is_symlink() and source.readlink() == target.readlink()
        )
        if not same and not (source.is_file() and sha256_of(source) == sha256_of(target)):
            raise BuildError(f"two packages ship {target}, differently")
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(source, target)


def merged_usr_links(root: Path) -> None:
    for name in MERGED:
        if (root / "usr" / name).exists():
            (root / name).symlink_to(f"usr/{name}")


def status_stanza(deb_file: Path) -> str:
    """The package's control fields as dpkg's status database holds them (scanners read it to
    know what is installed)."""
    control = run(["dpkg-deb", "-f", str(deb_file)], f"dpkg-deb -f {deb_file.name}").rstrip("\n")
    lines = control.splitlines()
    lines.insert(1, "Status: install ok installed")
    return "\n".join(lines) + "\n"
