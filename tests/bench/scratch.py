"""Scratch directories for benchmarks that fsync.

They live in the lab directory on the checkout's own disk, so a durable commit costs what it
costs on a node's disk (the system temp dir is often a tmpfs, where fsync is free).  Each
benchmark creates its own directory there and removes it when done.
"""

from __future__ import annotations

import tempfile

from harness import debs


def root() -> str:
    """The directory the benchmarks' scratch directories are made in."""
    path = debs.LAB / "bench-tmp"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def scratch(prefix: str = "bench-") -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=prefix, dir=root())
