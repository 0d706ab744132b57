"""Which runtime combinations a test runs on, as marks: the containerd versions with runc, and
the scenarios chosen to run once more with crun 1.8.1 (harness/crun.py).

crun runs only where it proves something runc does not: a container created with the
daemon's cpuset, the daemon's updates of running containers applied by ``crun update``, and
the OCI hook run by crun.  Every other test keeps runc (the ``oci_runtime`` fixture's
default), so the matrix costs a few tests, not a second suite.
"""

from __future__ import annotations

import pytest
from harness.containerd import VERSIONS
from harness.crun import RUNTIMES

CONTAINERD_VERSIONS = sorted(VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
_CASES = [(v, "runc") for v in CONTAINERD_VERSIONS] + [(CONTAINERD_VERSIONS[-1], "crun")]

# Every containerd version with runc (ids as the ``containerd`` fixture's), and the newest
# with crun as the runc handler's binary (``containerd-2.3-crun``).
ALSO_CRUN = pytest.mark.parametrize(
    ("containerd_version", "oci_runtime"),
    _CASES,
    ids=[f"containerd-{v}" + ("" if r == "runc" else f"-{r}") for v, r in _CASES],
)
# CRI-O with its default runtime handler on runc, then on crun (ids ``runc`` / ``crun``).
CRIO_BOTH = pytest.mark.parametrize("oci_runtime", RUNTIMES)
# crun alone (containerd 2.3): what only crun 1.8.1 does.
ONLY_CRUN = pytest.mark.parametrize(
    ("containerd_version", "oci_runtime"),
    [(CONTAINERD_VERSIONS[-1], "crun")],
    ids=[f"containerd-{CONTAINERD_VERSIONS[-1]}-crun"],
)
