"""The compiled Python packages for a guest whose python3 is not the host venv's.

The guest runs the tests' code and the daemon with the host's site-packages on its path
(guest.py).  Pure-Python packages and protobuf's ``abi3`` extension load under any python3
from 3.9; orjson's and grpcio's extensions are built for one minor version (the venv's cp311),
so the trixie guest (python 3.13) gets those two as the same releases' wheels for its own
version, unpacked in the lab and put on its path before the host's site-packages.

Each wheel is downloaded once by pip with ``--require-hashes`` (a changed file on the index
fails with pip's message) and unpacked (a wheel is a zip file; nothing is installed).
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import debs


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str  # the host venv's release: the guest runs the same code
    sha256: str  # of the cp313 manylinux wheel


# The host venv's orjson and grpcio (pyproject's [project] and [test] dependencies), as PyPI's
# cp313 manylinux_2_17 wheels.
CP313 = (
    Wheel("orjson", "3.13.0", "cbed5f4c4b88d94bcc36115f4c3bb3aa25da1563a5c3328aa3acebce2b083040"),
    Wheel("grpcio", "1.85.3", "9d20015c0dfc91de7a9a037cc84c7a174e8fe62e6427f563f1e2e35ca10f3798"),
)
WHEELS = {"3.13": CP313}


class GuestPythonError(RuntimeError):
    """A wheel could not be downloaded or unpacked; the message has pip's reason."""


def site_dir(python: str, lab: Path = debs.LAB) -> Path | None:
    """The directory of the builds for guest ``python`` (``"3.13"``), made once; None when
    the host's site-packages serve it as they are (the venv's own minor version)."""
    if python == f"{sys.version_info.major}.{sys.version_info.minor}":
        return None
    wheels = WHEELS.get(python)
    if wheels is None:
        raise GuestPythonError(
            f"no wheels for a guest python {python}: add its builds of orjson and grpcio to "
            "tests/harness/guest_python.py (WHEELS)"
        )
    tag = "-".join(f"{w.name}{w.version}" for w in wheels)
    target = lab / "guest" / "python" / f"cp{python.replace('.', '')}-{tag}"
    if (target / ".done").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".done").exists():
            _make(target, python, wheels)
    return target


def _make(target: Path, python: str, wheels: tuple[Wheel, ...]) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    downloads = partial / ".wheels"
    downloads.mkdir(parents=True)
    requirements = partial / ".requirements.txt"
    requirements.write_text(
        "".join(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n" for w in wheels)
    )
    abi = f"cp{python.replace('.', '')}"
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--require-hashes", "--python-version", python, "--implementation", "cp",
        "--abi", abi, "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
        "-r", str(requirements), "-d", str(downloads),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if result.returncode:
        raise GuestPythonError(
            f"pip download of the guest's {abi} wheels failed (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-1500:]}"
        )
    for wheel in sorted(downloads.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(partial)
    shutil.rmtree(downloads)
    requirements.unlink()
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    (target / ".done").touch()
