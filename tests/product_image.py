"""The product's image for the tests: ``packaging/image/image_build.py`` (``./dev image``),
built once per set of inputs and kept in the lab, so the suites that load it pay for one build.

The key is HEAD (the build takes the project from the committed tree) and every file of
packaging/image/ (the recipe and its locks, committed or not).  Downloads are cached in
``<lab>/image-build`` like the developer's own builds.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from harness.debs import LAB

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "packaging/image"
BUILD = RECIPE / "image_build.py"
KEEP = 4  # images kept in the lab (HEAD's and an older release's, in two work trees)
RELEASE_0_1_0 = "2582d766159050c7de6186ca8722dc4c4b9bd145"  # CHANGELOG.md: upgrades start there
MANIFEST = "packaging/kubernetes/daemonset.yaml"


@dataclass(frozen=True)
class Built:
    archive: Path
    digest: str
    output: str  # the build's stdout: the layer lines, the archive line, the digest


def recipe() -> ModuleType:
    """packaging/image/image_build.py as a module (its siblings import as top-level modules)."""
    if str(RECIPE) not in sys.path:
        sys.path.insert(0, str(RECIPE))
    return importlib.import_module("image_build")


def build(output: Path, work: Path | None = None, revision: str = "HEAD") -> Built:
    """One build, as ``./dev image --output OUTPUT [--revision REV]`` does it."""
    work = work or LAB / "image-build"
    result = subprocess.run(
        [
            sys.executable,
            str(BUILD),
            "--output",
            str(output),
            "--work",
            str(work),
            "--revision",
            revision,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if result.returncode:
        raise RuntimeError(f"image build failed ({result.returncode}): {result.stderr[-3000:]}")
    [archive] = output.glob("*.oci.tar")
    return Built(archive, result.stdout.splitlines()[-1], result.stdout)


def _key(revision: str) -> str:
    digest = hashlib.sha256()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", revision], capture_output=True, text=True, check=True
    )
    digest.update(head.stdout.encode())
    for path in sorted(
        p for p in RECIPE.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ):
        digest.update(path.relative_to(RECIPE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _prune(images: Path, keep: int) -> None:
    """Only the images used last stay: each commit's is ~70 MB.  Not the newest one alone: other
    work trees sharing the lab may be using theirs, and a test uses an older release's."""
    built = sorted(
        (p for p in images.iterdir() if (p / "output.txt").exists()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in built[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def manifest_of(revision: str, directory: Path) -> Path:
    """The DaemonSet manifest as the release at ``revision`` shipped it, written in
    ``directory``."""
    text = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:{MANIFEST}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = directory / f"daemonset-{revision[:12]}.yaml"
    path.write_text(text)
    return path


def cached(lab: Path = LAB, revision: str = "HEAD") -> Built:
    """The image of ``revision``, built on first use and kept under
    ``<lab>/product-image/<key>``."""
    target = lab / "product-image" / _key(revision)
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".lock").open("w") as lock:  # parallel workers share it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "output.txt").exists():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            built = build(partial, revision=revision)
            (partial / "output.txt").write_text(built.output)
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
            _prune(target.parent, keep=KEEP)
        else:
            os.utime(target)  # used now: the last to be pruned (an older release's, say)
        [archive] = target.glob("*.oci.tar")
        output = (target / "output.txt").read_text()
    return Built(archive, output.splitlines()[-1], output)


DOCKERFILE = REPO / "packaging/Dockerfile"


def dockerfile_steps(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        instruction, _, rest = line.partition(" ")
        out.append((instruction.upper(), rest.strip()))
    return out
