"""Short private directories for the paths that tools limit by length or by character.

The lab lives in the checkout (``<checkout>/.lab``), and a checkout can be anywhere: deep in a CI
workspace, under a ``mktemp -d`` directory, with spaces in its name.  Most of what the harness
puts in the lab does not care, but a few paths are handed to something that does:

======================================  ==================================================
limit                                   what lives in a short directory because of it
======================================  ==================================================
unix socket path: 108 bytes             containerd's gRPC, ttrpc and NRI sockets (and so
(``sun_path``, also gRPC's ``unix:``)   every client: CRI, ``ctr``, NRI plugins, the daemon)
podman: runroot at most 50 characters   podman's runroot
overlay mount data: one page            containerd's root: the overlayfs snapshotter names
(lowerdir + upperdir + workdir)         three snapshot paths below it in every mount
shebang: 127 bytes before Linux 5.1,    the interpreter of the OCI hook launcher: a link
no whitespace (no quoting at all)       to the test interpreter (:func:`interpreter`)
======================================  ==================================================

cgroup names (255 bytes a component) never contain a path: they are built from tokens and
container ids only, so they need nothing here.

Each directory is made under /run - or /tmp where /run is not writable - with mode 0700 and a
fresh name (``mkdtemp``, or an instance's random token), so its path is about 25 characters
whatever the checkout path, and holds an ``owner.json`` naming the test process that made it
(pid and start time).  Its owner removes it at teardown; :func:`stale` finds the ones whose
owner died (a killed test run), so the harness' ``reap_stale`` functions can remove them with
everything that used them.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import host

BASES = (Path("/run"), Path(tempfile.gettempdir()))
PREFIX = "nri-"
OWNER_FILE = "owner.json"
# The longest directory path accepted: podman's runroot (the longest name we put below a short
# directory is "/runroot") must stay within 50 characters with room to spare.
MAX_LENGTH = 32
# Private top cgroups of the harness; anything else in an owner record is not trusted.
_TOP = re.compile(r"/nri-[a-z0-9]+-[0-9a-f]+")


class ShortPathError(RuntimeError):
    """No short private directory could be made; the message says where it looked."""


def base() -> Path:
    """Where short directories are made: the first of :data:`BASES` root can write to."""
    for candidate in BASES:
        if candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    raise ShortPathError(f"none of {[str(b) for b in BASES]} is a writable directory")


def owner() -> list[int | None]:
    """This process as an owner record: pid and start time survive pid reuse."""
    return [os.getpid(), host.start_time(os.getpid())]


def make(kind: str, path: Path | None = None, within: Path | None = None, **meta: Any) -> Path:
    """A new short private directory for ``kind`` (``containerd``, ``podman``, ...), with
    ``meta`` (e.g. the instance directory and top cgroup) recorded next to its owner.
    ``path``: make exactly this one (see :func:`path_for`); it must not exist.  ``within``:
    one of :data:`BASES` other than :func:`base`, for something big (/run is often a small
    tmpfs)."""
    if within is not None and within not in BASES:
        raise ShortPathError(f"{within} is not one of {[str(b) for b in BASES]}")
    if path is None:
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=within or base()))
    else:
        path.mkdir(mode=0o700)
    if len(str(path)) > MAX_LENGTH or any(c.isspace() for c in str(path)):
        shutil.rmtree(path, ignore_errors=True)
        raise ShortPathError(f"{path} is not short enough (limit {MAX_LENGTH})")
    record = {"kind": kind, "owner": owner(), **{k: str(v) for k, v in meta.items()}}
    # Written before anything else goes in: a directory without a record is never touched by
    # a reaper, so the record must not be missing while the directory is in use.
    tmp = path / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(path / OWNER_FILE)
    return path


def path_for(kind: str, token: str) -> Path:
    """Where :func:`ensure` makes ``kind``'s directory for ``token`` (an instance's random
    token): known before anything is made, so reading an instance's paths makes nothing."""
    return base() / f"{PREFIX}{kind}-{token}"


def ensure(kind: str, path: Path, **meta: Any) -> Path:
    """``path`` made (as :func:`make` does) unless this process already made it; a directory
    of that name owned by anyone else is an error, never shared."""
    try:
        record = json.loads((path / OWNER_FILE).read_text())
    except FileNotFoundError:
        if path.exists():
            raise ShortPathError(f"{path} exists without an owner record") from None
        return make(kind, path, **meta)
    except (OSError, ValueError) as e:
        raise ShortPathError(f"{path}: unreadable owner record ({e})") from None
    if record.get("kind") != kind or record.get("owner") != owner():
        raise ShortPathError(f"{path} belongs to {record.get('owner')}, not to this process")
    return path


def stale(*kinds: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """``(directory, owner record)`` of every short directory of ``kinds`` whose owner is gone.
    Records with an implausible ``top`` cgroup are skipped: a reaper removes that tree."""
    for root in BASES:
        with contextlib.suppress(OSError):
            for path in sorted(root.glob(f"{PREFIX}*")):
                try:
                    record = json.loads((path / OWNER_FILE).read_text())
                    pid, started = record["owner"]
                    kind = record["kind"]
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # not ours, or still being made
                if kind not in kinds or host.start_time(pid) == started:
                    continue
                if "top" in record and not _TOP.fullmatch(record["top"]):
                    continue
                yield path, record


# --- the interpreter link ---------------------------------------------------------------------

_session: Path | None = None


def _session_dir() -> Path:
    """One short directory per test process, removed when the process exits."""
    global _session
    if _session is None or not _session.is_dir():
        _session = make("session")
        creator = os.getpid()

        def remove(path: Path = _session) -> None:
            if os.getpid() == creator:  # not in a forked child that happens to exit normally
                shutil.rmtree(path, ignore_errors=True)

        atexit.register(remove)
    return _session


def interpreter(python: Path | str = sys.executable) -> Path:
    """A short, whitespace-free path that runs ``python``, for shebangs.

    A symlink: the kernel follows it, and an interpreter started with ``-I -S`` (as the hook
    launcher starts it) only needs its standard library, which it finds through the link's
    target."""
    python = Path(python).absolute()  # the link's target is read relative to the link
    name = "python-" + hashlib.sha256(str(python).encode()).hexdigest()[:8]
    link = _session_dir() / name
    if not link.is_symlink():
        link.symlink_to(python)
    return link


def reap_sessions() -> list[str]:
    """Remove the session directories of test processes that died; returns what is left."""
    problems = []
    for path, _ in stale("session"):
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            problems.append(f"directory {path}")
    return problems
