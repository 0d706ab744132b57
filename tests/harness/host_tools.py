"""Host programs the guest node needs (QEMU, debootstrap, mkfs.ext4) and kubectl, installed from the
machine's own Debian suite when missing, as ``./dev`` installs python3-venv.

Only the host's configured sources are used (bookworm here): packages from other suites never
come through the system apt (debs.py has a private apt setup for those).  Recommends are left
out: ``qemu-system-x86`` would otherwise pull in a GUI stack the headless guest never uses.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

from .debs import LAB

# program -> the Debian package providing it
PROGRAMS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "debootstrap": "debootstrap",
    "mkfs.ext4": "e2fsprogs",
    "gpgv": "gpgv",
    "kubectl": "kubernetes-client",  # strategic-merge patches of the DaemonSet (kubelet_pod.py)
}
# apt waits this long for another apt/dpkg run (other sessions share the machine).
LOCK_TIMEOUT_S = 600


class HostToolError(RuntimeError):
    """A program could not be installed; the message carries apt's output."""


def _apt_get(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        ["apt-get", f"-oDPkg::Lock::Timeout={LOCK_TIMEOUT_S}", *args],
        capture_output=True, text=True, env=env, check=False, timeout=LOCK_TIMEOUT_S + 900,
    )  # fmt: skip


def ensure(*programs: str, lab: Path = LAB) -> dict[str, Path]:
    """The absolute path of each of ``programs`` (keys of :data:`PROGRAMS`), installing the
    missing ones' packages with apt first."""
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        lab.mkdir(parents=True, exist_ok=True)
        with (lab / "host-tools.lock").open("w") as lock:  # parallel sessions of ours
            fcntl.flock(lock, fcntl.LOCK_EX)
            missing = [p for p in programs if shutil.which(p) is None]
            if missing:
                _install(sorted({PROGRAMS[p] for p in missing}))
    found = {p: shutil.which(p) for p in programs}
    if absent := [p for p, path in found.items() if path is None]:
        raise HostToolError(f"{absent} still missing after installing {PROGRAMS[absent[0]]}")
    return {p: Path(path) for p, path in found.items() if path is not None}


def _install(packages: list[str]) -> None:
    install = ("install", "-y", "-qq", "--no-install-recommends", *packages)
    result = _apt_get(*install)
    if result.returncode:  # lists missing or stale on a fresh machine: refresh once
        update = _apt_get("update", "-qq")
        if update.returncode:
            raise HostToolError(f"apt-get update failed: {update.stderr.strip()[-1500:]}")
        result = _apt_get(*install)
    if result.returncode:
        raise HostToolError(
            f"apt-get install {' '.join(packages)} failed (exit {result.returncode}): "
            f"{result.stderr.strip()[-1500:]}"
        )
