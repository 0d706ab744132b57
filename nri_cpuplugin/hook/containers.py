"""The containers the hook recorded, as their cgroups show them: which still run and on what
(``live``), their CPU request (``shares``), and the checks made before trusting a container
id or pid from the runtime's input (``check_stopped``, ``check_container_cgroup``)."""

from __future__ import annotations

import errno

from ..core.cpuset import CPUSet
from ..core.reconcile import LiveContainer
from ..hardware import cgroupfs
from ..hardware.cgroupfs import CgroupError, CgroupFS
from . import oci
from .failure import HookFailure
from .records import Record

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    from collections.abc import Mapping


def live(
    fs: CgroupFS, known: set[str], records: Mapping[str, Record]
) -> tuple[list[LiveContainer], dict[str, CPUSet], list[str], set[str]]:
    """(known containers that still run - their recorded cgroup has processes - with the
    CPUs they run on; the cpusets their cgroups ask for; the stale rest; the evicted ones).
    The two sets differ only on cgroup v2, when an ancestor does not offer every CPU asked
    for.  Evicted (cgroup v1): the kernel emptied the cpuset when its last CPU went offline
    and moved the processes up; the cpu controller's cgroup still holds them."""
    running, requested, stale, moved_up = [], {}, [], set()
    for cid in sorted(known):
        record = records.get(cid)
        try:
            if record is not None and fs.populated(record.cgroups.cpuset):
                path = record.cgroups.cpuset
                running_on = fs.cpus(path)
                running.append(LiveContainer(record.workload, running_on))
                v2 = fs.layout.version == cgroupfs.V2
                requested[cid] = fs.requested(path) if v2 else running_on
                continue
            if record is not None and evicted(fs, record):
                running.append(LiveContainer(record.workload, CPUSet()))
                requested[cid] = CPUSet()
                moved_up.add(cid)
                continue
        except CgroupError as err:
            if err.errno not in GONE:
                # Out of descriptors, say: it may well run there, and its CPUs must not
                # be given to anyone else on a guess.
                raise HookFailure(
                    f"cannot tell whether container {cid} still runs: {err}; nothing was changed"
                ) from None
            # Its cgroup is gone, or its recorded path names none: not running there.
        stale.append(cid)
    return running, requested, stale, moved_up


def shares(fs: CgroupFS, cpu_cgroup: str | None) -> int | None:
    """The cpu.shares of a container's cpu cgroup now; None when it cannot be read."""
    if fs.layout.version != cgroupfs.V1 or cpu_cgroup is None:
        # cgroup v2's cpu.weight is kubelet's shares squeezed into 1-10000: it cannot give
        # the request back exactly, and a wrong guess would move a container.  Not caught.
        return None
    try:
        return int(fs.read("cpu", cpu_cgroup, "cpu.shares"))
    except (CgroupError, ValueError):
        return None


def evicted(fs: CgroupFS, record: Record) -> bool:
    """cgroup v1: the container's cpuset holds no process but its cpu cgroup does - the kernel
    moved its processes up when the cpuset lost its last CPU (see cpusets.py)."""
    if fs.layout.version != cgroupfs.V1 or record.cgroups.cpu is None:
        return False
    if not fs.exists("cpuset", record.cgroups.cpuset):
        return False
    return bool(fs.read("cpu", record.cgroups.cpu, "cgroup.procs"))


def check_stopped(fs: CgroupFS, cid: str, record: Record | None) -> None:
    """A poststop's container id comes from stdin: release nothing whose recorded cgroup still
    holds processes (runtimes run poststop after the container's processes are gone and its
    cgroup removed), so a forged or misdirected run cannot hand a running container's
    exclusive CPUs to the next one.  Without a record there is nothing to check: the state
    cannot name such a container as the hook's own."""
    if record is None:
        return
    try:
        running = fs.populated(record.cgroups.cpuset) or evicted(fs, record)
    except CgroupError as err:
        if err.errno in GONE:
            return
        raise HookFailure(
            f"poststop for container {cid}: cannot tell whether it still runs: {err}; "
            "nothing was changed"
        ) from None
    if running:
        raise HookFailure(
            f"poststop for container {cid}, but its cgroup {record.cgroups.cpuset} still has "
            "processes: it keeps its CPUs and nothing was changed (runtimes run poststop after "
            "a container's processes are gone; is the hook entry's stage right?)"
        )


# What a cgroup read fails with when the cgroup is not there (None: a path refused before any
# system call - a record naming no cgroup).
GONE = (None, errno.ENOENT, errno.ENODEV, errno.ENOTDIR)


def check_container_cgroup(path: str, cid: str, pid: int) -> None:
    """The pid comes from the runtime: make sure we are about to write the container's own
    cgroup, not the root or a pod-wide one (runtimes name the container's cgroup after its id:
    ``crio-<id>``, ``<id>``, ``libpod-<id>``, crun's ``crio-<id>.scope/container``)."""
    parts = cgroupfs.split_path(path)
    if not parts:
        raise oci.InputError(f"process {pid} is in the root cgroup, not in a container's cgroup")
    if not any(names(part, cid) for part in parts[-2:]):
        raise oci.InputError(
            f"the cgroup {path} of process {pid} is not named after container {cid}; refusing "
            "to write it (is pid the container's init process?)"
        )


def names(part: str, cid: str) -> bool:
    """Whether a cgroup path component is named after the container: ``<id>``, or
    ``<prefix>-<id>``, either with an optional ``.scope`` - never merely containing it (a
    short id would match every container's cgroup)."""
    name = part.removesuffix(".scope")
    return name == cid or name.endswith(f"-{cid}")
