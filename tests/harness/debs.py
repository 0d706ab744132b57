"""Debian packages for the tests, fetched without touching the machine's apt configuration.

trixie/sid packages (containerd, the NRI Go sources) come through a *private* apt setup: our
own sources.list, lists directory and cache under the lab directory, so the system's sources,
pins and installed packages stay exactly as they were.  Every .deb is checked against a pinned
SHA256 before it is unpacked with ``dpkg -x``, so a changed archive cannot silently change a
test.  Downloads and unpacked trees are cached in the lab directory between runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Absolute once, here: the harness starts runtimes in other working directories.
LAB = Path(os.environ.get("NRI_LAB_DIR", REPO / ".lab")).absolute()
SUITES = ("bookworm", "trixie", "sid")
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


class DebError(RuntimeError):
    """A package could not be fetched or did not match its pin; the message says which."""


@dataclass(frozen=True)
class Deb:
    name: str
    version: str
    sha256: str
    arch: str = "amd64"

    @property
    def filename(self) -> str:
        # apt encodes ':' of epochs as %3a in file names.
        return f"{self.name}_{self.version.replace(':', '%3a')}_{self.arch}.deb"


def _archive_uri() -> str:
    """The machine's Debian mirror (the bookworm stanza), so we use what the host may reach."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for stanza in sources.read_text().split("\n\n"):
            if re.search(r"^Suites:.*\bbookworm\b(?!-security)", stanza, re.M) and (
                match := re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            ):
                return match.group(1)
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
                return next(p for p in parts[1:] if not p.startswith("["))
    raise DebError("no bookworm apt source found in /etc/apt to derive the Debian mirror from")


def _apt_options(apt_dir: Path) -> list[str]:
    return [
        f"-o=Dir::Etc::SourceList={apt_dir / 'sources.list'}",
        "-o=Dir::Etc::SourceParts=/nonexistent",
        f"-o=Dir::State::Lists={apt_dir / 'lists'}",
        f"-o=Dir::Cache={apt_dir / 'cache'}",
        "-o=APT::Get::List-Cleanup=0",
        "-o=Debug::NoLocking=1",
    ]


def _private_apt(lab: Path) -> list[str]:
    apt_dir = lab / "apt"
    (apt_dir / "lists/partial").mkdir(parents=True, exist_ok=True)
    (apt_dir / "cache/archives/partial").mkdir(parents=True, exist_ok=True)
    uri = _archive_uri()
    (apt_dir / "sources.list").write_text(
        "".join(f"deb [signed-by={KEYRING}] {uri} {suite} main\n" for suite in SUITES)
    )
    options = _apt_options(apt_dir)
    stamp = apt_dir / "updated"
    if not stamp.exists():
        _run(["apt-get", *options, "update", "-qq"], "apt-get update (private lists)")
        stamp.touch()
    return options


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode:
        raise DebError(f"{what} failed (exit {result.returncode}): {result.stderr.strip()[-800:]}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(deb: Deb, lab: Path = LAB) -> Path:
    """Download (once) and verify ``deb``; return the path of the .deb file."""
    debs = lab / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    path = debs / deb.filename
    with (lab / "debs.lock").open("w") as lock:  # parallel test workers share the cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            options = _private_apt(lab)
            try:
                _run(
                    ["apt-get", *options, "download", f"{deb.name}={deb.version}"],
                    f"apt-get download {deb.name}={deb.version}",
                    cwd=debs,
                )
            except DebError:
                # The lists may be stale (a version superseded since): refresh once, retry.
                (lab / "apt/updated").unlink(missing_ok=True)
                options = _private_apt(lab)
                _run(
                    ["apt-get", *options, "download", f"{deb.name}={deb.version}"],
                    f"apt-get download {deb.name}={deb.version}",
                    cwd=debs,
                )
        actual = _sha256(path)
        if actual != deb.sha256:
            path.rename(path.with_suffix(".deb.rejected"))
            raise DebError(
                f"{deb.filename}: SHA256 {actual} does not match the pinned {deb.sha256}; "
                "the archive changed - check the package and update the pin deliberately"
            )
    return path


def unpack(deb: Deb, lab: Path = LAB) -> Path:
    """``dpkg -x`` the verified package into the lab (once); return the tree's root."""
    target = lab / "pkgs" / f"{deb.name}_{deb.version.replace(':', '_')}"
    done = target / ".unpacked"
    if done.exists():
        return target
    path = fetch(deb, lab)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _run(["dpkg", "-x", str(path), str(partial)], f"dpkg -x {path.name}")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    done.touch()
    return target
