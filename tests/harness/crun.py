"""crun 1.8.1 (bookworm) as the OCI runtime of the private containerd and CRI-O instances.

CRI-O on Fedora, RHEL and OpenShift runs crun, not runc; containerd runs it as a
runc-compatible binary (``io.containerd.runc.v2`` with ``BinaryName``).  Both runtimes call it
with runc's command line (``--root``, ``--log``, ``create --bundle``, ``update --resources``...),
which crun accepts as is.

Three things this host and these runtimes need (each seen with the real binary):

1. Its library: crun links libyajl2, which this host does not have.  The pinned bookworm package
   is unpacked in the lab and crun's RUNPATH names it, so no ``LD_LIBRARY_PATH`` reaches the
   hooks crun runs.  The path is absolute: crun re-executes itself from a sealed memfd (its
   guard against CVE-2019-5736), where ``$ORIGIN`` names nothing; the cached binary is keyed
   by that path, so a lab that moved gets its own.
2. The hybrid cgroup layout: this host mounts cgroup v2 at /sys/fs/cgroup/unified with the
   ``hugetlb`` controller in it, and crun 1.8.1 refuses that at ``create`` ("cgroups in hybrid
   mode not supported, drop all controllers from cgroupv2").  The runtime path is a wrapper that
   runs crun in a private mount namespace without that one mount: crun then sees a cgroup v1
   host, which is what a cgroup v1 node is, and creates the container's cgroups in every v1
   hierarchy as runc does.  Nothing of the host changes; the container's own mount namespace is
   made from that private one.
3. The spec version: containerd 2.3.4 and CRI-O 1.36.3 write ``"ociVersion": "1.3.0"`` (1.7.24
   ``1.2.0``, 2.1.9 ``1.2.1``), and crun 1.8.1 accepts only 1.0.x and 1.1.x ("unknown version
   specified"; crun dropped that check in 1.14.3).  The wrapper writes ``1.1.0`` into the
   bundle's config.json before ``create``, as a crun >= 1.14.3 would simply not look.  Nothing
   else of the spec changes, and nothing this project relies on (cpuset, hooks, namespaces) is
   newer than spec 1.0.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
from pathlib import Path

from . import debs
from .packages import CRUN, LIBYAJL2, PATCHELF

LIB = "usr/lib/x86_64-linux-gnu"
# `crun --version` (CRI-O asks it at start, without --root) makes crun's default state root.
DEFAULT_RUNDIR = Path("/run/crun")
VERSION = "1.8.1"
# The OCI runtimes an instance can run: runc is every test's, crun the chosen scenarios'.
RUNTIMES = ("runc", "crun")
# Plain sh: it runs for every call the shim, conmon or CRI-O make; only ``create`` and ``run``
# touch the bundle.  Global options that take a value are skipped, so that their value is never
# taken for the command.  The cgroup v2 mount is hidden only if it is there (a cgroup file's
# size reads 0, so its being there is the test).
_WRAPPER = r"""#!/bin/sh
# Written by tests/harness/crun.py: crun 1.8.1 on a spec it accepts, without this host's hybrid
# cgroup v2 mount.
crun=__CRUN__
bundle=.
command=
skip=
previous=
for arg in "$@"; do
  if [ -n "$skip" ]; then skip=; previous=$arg; continue; fi
  case "$previous" in --bundle|-b) bundle=$arg ;; esac
  case "$arg" in
    --bundle=*) bundle=${arg#--bundle=} ;;
    --root|--log|--log-format|--cgroup-manager|--rootless) [ -z "$command" ] && skip=1 ;;
    -*) ;;
    *) [ -z "$command" ] && command=$arg ;;
  esac
  previous=$arg
done
case "$command" in
  create|run)
    if [ -f "$bundle/config.json" ]; then
      sed -i 's/"ociVersion":[[:space:]]*"1\.[2-9][^"]*"/"ociVersion":"1.1.0"/' \
        "$bundle/config.json"
    fi ;;
esac
unified=/sys/fs/cgroup/unified
if [ -e "$unified/cgroup.controllers" ]; then
  exec unshare --mount --propagation private sh -c 'umount -l "$0" && exec "$@"' \
    "$unified" "$crun" "$@"
fi
exec "$crun" "$@"
"""


class CrunError(RuntimeError):
    """crun could not be prepared; the message says what failed."""


def binary(lab: Path = debs.LAB) -> Path:
    """The crun binary with a RUNPATH to the extracted libyajl2 (built once, cached)."""
    tree = debs.unpack(CRUN, lab)
    libs = (debs.unpack(LIBYAJL2, lab) / LIB).resolve()
    key = hashlib.sha256(
        ":".join([str(libs), *(deb.sha256 for deb in (CRUN, LIBYAJL2, PATCHELF))]).encode()
    ).hexdigest()[:12]
    target_dir = lab / "crun-bin" / key
    target = target_dir / "crun"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with (target_dir.parent / ".lock").open("w") as lock:  # parallel workers share the cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        patchelf = debs.unpack(PATCHELF, lab) / "usr/bin/patchelf"
        partial = target_dir / "crun.partial"
        shutil.copy2(tree / "usr/bin/crun", partial)
        result = subprocess.run(
            [str(patchelf), "--set-rpath", str(libs), str(partial)], capture_output=True, text=True
        )
        if result.returncode:
            raise CrunError(f"patchelf on crun failed: {result.stderr.strip()}")
        partial.rename(target)
    return target


def write_wrapper(path: Path, lab: Path = debs.LAB) -> Path:
    """Write the runtime path the instances name for crun (workaround 2) at ``path``."""
    quoted = "'" + str(binary(lab)).replace("'", "'\\''") + "'"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_WRAPPER.replace("__CRUN__", quoted))
    path.chmod(0o755)
    return path


def check_runtime(name: str) -> str:
    """``name`` if it is a runtime the harness can run; a clear error otherwise."""
    if name not in RUNTIMES:
        raise ValueError(f"OCI runtime {name!r}: expected one of {list(RUNTIMES)}")
    return name


def remove_default_rundir() -> None:
    """Remove /run/crun if it is empty: every instance gives crun a state root of its own, so
    only ``crun --version`` made it (another crun's containers would leave it non-empty)."""
    with contextlib.suppress(OSError):
        DEFAULT_RUNDIR.rmdir()
