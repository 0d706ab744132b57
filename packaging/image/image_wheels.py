"""The image's Python packages: the project's wheel, built from a commit with a pinned build
backend, and its dependencies' wheels, pinned by hash; each installed into the root filesystem
as pip would install it for Debian's /usr/bin/python3.11, without running pip there.

Installing means: the wheel's files into site-packages (its ``.data`` directories where the wheel
format puts them) and a small launcher per console script.  Their bytecode is written afterwards
by the image's own interpreter (image_bytecode.py).
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

from image_debs import BuildError, run, sha256_of

INTERPRETER = "/usr/bin/python3.11"
# Where pip puts a root install for Debian's python3.11 (its site module adds this directory).
SITE = "usr/local/lib/python3.11/dist-packages"
SCRIPTS = "usr/local/bin"
PREFIX = "usr/local"
# The dependencies' wheels are CPython 3.11 on x86-64 glibc (Debian 12 has glibc 2.36).
PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--platform=manylinux_2_28_x86_64",
    "--platform=manylinux_2_17_x86_64",
    "--platform=manylinux2014_x86_64",
    "--python-version=3.11",
    "--implementation=cp",
    "--abi=cp311",
    "--abi=abi3",
    "--abi=none",
]


def pip(args: list[str], what: str) -> None:
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], what)


def download(lock: Path, dest: Path) -> list[Path]:
    """The locked wheels, hash-checked, in ``dest`` (kept between builds: pip re-checks them)."""
    dest.mkdir(parents=True, exist_ok=True)
    pip(
        ["download", "-q", "--require-hashes", "--no-deps", *PLATFORM_ARGS, "-d", str(dest),
         "-r", str(lock)],
        f"pip download -r {lock.name}",
    )  # fmt: skip
    hashes = set(re.findall(r"--hash=sha256:([0-9a-f]{64})", lock.read_text()))
    wheels = sorted(w for w in dest.glob("*.whl") if sha256_of(w) in hashes)
    expected = len(_requirements(lock))
    if len(wheels) != expected:
        names = [w.name for w in wheels]
        raise BuildError(f"{dest}: expected {expected} wheels matching {lock.name}, got {names}")
    return wheels


def _requirements(lock: Path) -> list[str]:
    joined = lock.read_text().replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def build_backend(lock: Path, dest: Path) -> Path:
    """The pinned setuptools, unpacked into ``dest`` once."""
    if not (dest / ".done").exists():
        shutil.rmtree(dest, ignore_errors=True)
        pip(
            ["install", "-q", "--require-hashes", "--no-deps", "--no-compile", "--target",
             str(dest), "-r", str(lock)],
            f"pip install -r {lock.name}",
        )  # fmt: skip
        (dest / ".done").touch()
    return dest


def project_wheel(repo: Path, revision: str, backend: Path, work: Path, epoch: int) -> Path:
    """The project's wheel, built from the committed tree of ``revision`` (``git archive``: no
    untracked or uncommitted file gets in) with the pinned backend and SOURCE_DATE_EPOCH."""
    source, out = work / "source", work / "dist"
    shutil.rmtree(source, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    source.mkdir(parents=True)
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", revision], capture_output=True, check=False
    )
    if archive.returncode:
        raise BuildError(f"git archive {revision} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(backend),
        "SOURCE_DATE_EPOCH": str(epoch),
        "PYTHONHASHSEED": "0",
    }
    build = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", build, str(out)],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        raise BuildError(f"building the project's wheel failed: {result.stderr.strip()[-1500:]}")
    return out / result.stdout.strip().splitlines()[-1]


def install(wheel: Path, root: Path) -> None:
    """Unpack ``wheel`` into ``root`` as pip would for /usr/bin/python3.11, scripts included."""
    site = root / SITE
    with zipfile.ZipFile(wheel) as archive:
        dist_info = _dist_info(archive, wheel)
        for member in archive.infolist():
            if member.is_dir():
                continue
            target = _target(PurePosixPath(member.filename), root, site, dist_info)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink)
            executable = (member.external_attr >> 16) & 0o100
            target.chmod(0o755 if executable or target.parent == root / SCRIPTS else 0o644)
        entry_points = f"{dist_info}/entry_points.txt"
        if entry_points in archive.namelist():
            _console_scripts(archive.read(entry_points).decode(), root / SCRIPTS)


def _dist_info(archive: zipfile.ZipFile, wheel: Path) -> str:
    tops = {PurePosixPath(n).parts[0] for n in archive.namelist()}
    found = [t for t in tops if t.endswith(".dist-info")]
    if len(found) != 1:
        raise BuildError(f"{wheel.name}: not a wheel (no single .dist-info directory)")
    return found[0]


def _target(name: PurePosixPath, root: Path, site: Path, dist_info: str) -> Path:
    if ".." in name.parts or name.is_absolute():
        raise BuildError(f"a wheel member escapes its directory: {name}")
    data = dist_info.removesuffix(".dist-info") + ".data"
    if name.parts[0] != data:
        return site / name
    kind, rest = name.parts[1], PurePosixPath(*name.parts[2:])
    where = {
        "purelib": site,
        "platlib": site,
        "scripts": root / SCRIPTS,
        "data": root / PREFIX,
        "headers": root / PREFIX / "include/python3.11",
    }
    if kind not in where:
        raise BuildError(f"unknown wheel data directory {kind!r} in {name}")
    return where[kind] / rest


def _console_scripts(text: str, bin_dir: Path) -> None:
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    if not parser.has_section("console_scripts"):
        return
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, reference in sorted(parser.items("console_scripts")):
        module, _, attribute = reference.split("[")[0].strip().partition(":")
        first, *rest = attribute.split(".")
        call = ".".join([first, *rest])
        script = bin_dir / name
        script.write_text(
            f"#!{INTERPRETER}\nimport sys\nfrom {module} import {first}\nsys.exit({call}())\n"
        )
        script.chmod(0o755)
