"""Writing containers' cpusets from outside the runtime (daemon and hook), and the repairs
that CPU hotplug needs.

The daemon writes the cpusets of shared containers directly when the shared pool changes
(flat cost per event, instead of one ``runc update`` per container run by the runtime), and
after CPU hotplug.  Every write takes CPUs away before CPUs are given, so no CPU is ever in
more places than it already was.

Hotplug repairs.  cgroup v1 removes an offlined CPU from every cpuset and never adds
it back; a cpuset left without CPUs has its tasks moved by the kernel to the nearest ancestor
that still has some (asynchronously, from a workqueue).  So after a change:

* ancestors of our containers' cgroups must be grown top-down before a container can get a
  returning CPU (``cgroup_writes.set_cpuset`` does that for every write);
* tasks the kernel evicted must be put back into their container's cpuset once it has CPUs
  again: they are found in the ancestors' ``cgroup.procs`` by their other controllers' cgroup
  (cpu, memory), which the kernel left where runc put them.

cgroup v2 needs neither: ``cpuset.cpus`` keeps the configuration and ``.effective`` follows the
online CPUs by itself.  Background: docs/cgroups-and-hooks.md §12 (cgroups), §13 (uevents).
"""

from __future__ import annotations

import os

from ..base.value import Value
from ..core.cpuset import CPUSet
from ..core.events import WARNING, AuditEvent, event
from ..core.outcome import CFS_PERIOD_US
from . import cgroup_writes, cgroupfs
from .liveness import cgroup_path

TYPE_CHECKING = False  # collections.abc is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Iterable

    from .cpuset_files import OpenCpusets

# Controllers whose cgroup the kernel does not move when it evicts tasks from a cpuset.
_WITNESSES = ("cpu", "cpu,cpuacct", "cpuacct,cpu", "memory", "pids")


def repair_events(returned: dict[str, int], errors: list[str]) -> list[AuditEvent]:
    """The audit events of one round of cgroup repairs: processes put back, and what failed."""
    events = []
    for cid, moved in sorted(returned.items()):
        events.append(
            event(
                "cgroup-repair",
                f"put {moved} processes of container {cid[:12]} back into its cpuset (cgroup "
                "v1 had moved them out when the cpuset lost its last CPU)",
                container_id=cid,
                processes=moved,
            )
        )
    for error in errors:
        events.append(
            event("cgroup-repair", f"cpuset repair failed: {error}", WARNING, reason=error)
        )
    return events


class Target(Value):
    """A container cgroup to bring to a cpuset (and a CFS quota, when one is given)."""

    container_id: str
    runtime_path: str  # the runtime's cgroupsPath (cgroupfs or systemd notation)
    cpus: CPUSet
    mems: CPUSet | None = None
    # CFS quota in microseconds per CFS_PERIOD_US, -1 for none; None leaves the quota alone.
    quota: int | None = None
    mems_from_parent: bool = False  # (core/outcome.py Target)


class Applied(Value):
    errors: list[str]  # one line per container that could not be written
    failed: list[str]  # their ids
    returned: dict[str, int]  # container id -> processes put back into its cpuset (v1)


def apply(
    layout: cgroupfs.Layout, targets: Iterable[Target], proc: str = "/proc", repair: bool = True
) -> Applied:
    """Write each target's cpuset (ancestors grown top-down first), CPUs taken away before
    CPUs are given, and its CFS quota when it has one (the same transaction: both or
    neither); then, with ``repair`` on cgroup v1, put back tasks the kernel evicted (after
    CPU hotplug).  One container's failure (it may be exiting) does not stop the others."""
    errors: list[str] = []
    failed: list[str] = []
    returned: dict[str, int] = {}
    with cgroupfs.CgroupFS(layout) as fs:
        resolved = []
        for target in targets:
            path = cgroup_path(target.runtime_path)
            try:
                current = fs.cpus(path)
            except cgroupfs.CgroupError as err:
                errors.append(f"{target.container_id[:12]}: {err}")
                failed.append(target.container_id)
                continue
            resolved.append((bool(current - target.cpus), path, target))
        resolved.sort(key=lambda item: (not item[0], item[2].container_id))
        for _, path, target in resolved:
            tx = cgroup_writes.Transaction(fs)
            try:
                with tx:
                    cgroup_writes.set_cpuset(
                        tx, path, target.cpus, target.mems, target.mems_from_parent
                    )
                    # The runtime's cgroupfs driver uses one path in every hierarchy.
                    if target.quota is not None and target.quota < 0:
                        cgroup_writes.lift_quota(tx, path)
                    elif target.quota is not None:
                        cgroup_writes.limit_quota(tx, path, target.quota, CFS_PERIOD_US)
                if repair and layout.version == cgroupfs.V1:
                    moved = return_evicted_tasks(fs, path, proc)
                    if moved:
                        returned[target.container_id] = moved
            except cgroupfs.CgroupError as err:
                error = f"{target.container_id[:12]}: {err}"
                if tx.rollback_errors:
                    error += f" (undoing earlier writes failed: {'; '.join(tx.rollback_errors)})"
                errors.append(error)
                failed.append(target.container_id)
    return Applied(errors, failed, returned)


def move(
    layout: cgroupfs.Layout,
    targets: Iterable[Target],
    unbalanced: set[str] | None = None,
    files: OpenCpusets | None = None,
) -> Applied:
    """Move shared containers to a new pool: ``apply`` without repairs, for the common case.

    A shared container's cgroup is normally a leaf whose ancestors kubelet left whole, so one
    write of ``cpuset.cpus`` is all it takes; on a dense node the difference to ``apply``'s
    general path (read every ancestor and the subtree first) is most of an event's cost.  A
    cgroup with cgroups nested below it (its directory's link count says so, without listing
    it), a refused write (cgroup v1: an ancestor lacks the CPUs, or a child still uses CPUs
    being removed), a set the kernel did not apply as written (cgroup v2), or a target with
    memory nodes to set or a CFS quota goes through ``apply``, which handles each of those.

    ``unbalanced``: the containers whose cgroup no longer asks for a scheduler domain of its
    own (see ``stop_balancing``); those written first are added to it.  ``files``: their
    ``cpuset.cpus`` kept open between writes (cgroup v1; hardware/cpuset_files.py)."""
    general: list[Target] = []
    targets = list(targets)
    with cgroupfs.CgroupFS(layout) as fs:
        if unbalanced is not None:
            stop_balancing(fs, [(t.container_id, t.runtime_path) for t in targets], unbalanced)
        for target in targets:
            if (
                target.mems
                or target.mems_from_parent
                or target.quota is not None
                or not _write_leaf(fs, target, files)
            ):
                general.append(target)
                if files is not None:  # written below, not through the kept file
                    files.written_elsewhere(target.container_id)
    if not general:
        return Applied([], [], {})
    return apply(layout, general, repair=False)


def stop_balancing(
    fs: cgroupfs.CgroupFS, containers: list[tuple[str, str]], done: set[str]
) -> None:
    """cgroup v1, where the root cpuset load-balances every CPU (the default): clear
    ``cpuset.sched_load_balance`` in these (container id, runtime path) cgroups, once each
    (``done`` keeps the ids).  It changes nothing for the scheduler - the root's one domain
    covers every CPU - but while it is set, every write of the cgroup's ``cpuset.cpus`` makes
    the kernel rebuild the scheduler domains: about half of each write's cost, paid for each
    shared container every time an exclusive container comes or goes.  A failure (the cgroup
    is gone, say) is left to the cpuset write that follows."""
    todo = [(cid, path) for cid, path in containers if cid not in done]
    if not todo or fs.layout.version != cgroupfs.V1:
        return
    try:
        if fs.read("cpuset", "/", "cpuset.sched_load_balance") != "1":
            return  # the scheduler is partitioned: these flags would matter
    except cgroupfs.CgroupError:
        return
    for cid, path in todo:
        done.add(cid)
        try:  # (no contextlib: the OCI hook may load this module)
            fs.write("cpuset", cgroup_path(path), "cpuset.sched_load_balance", "0")
        except cgroupfs.CgroupError:
            continue


def _write_leaf(fs: cgroupfs.CgroupFS, target: Target, files: OpenCpusets | None = None) -> bool:
    """One write of the target's CPUs to its container cgroup, if that cgroup is a leaf."""
    try:
        path = cgroup_path(target.runtime_path)
        if files is not None and files.write(fs, target.container_id, path, target.cpus):
            return True
        if fs.subdirectories(path):
            return False
        if fs.layout.version != cgroupfs.V2:
            fs.write("cpuset", path, "cpuset.cpus", str(target.cpus))  # v1 refuses what is wrong
            return True
        # v2 never refuses a write; it applies the intersection with the ancestors.  What it
        # did not apply as written is put back and left to the general path.
        with cgroup_writes.Transaction(fs) as tx:
            tx.write("cpuset", path, "cpuset.cpus", str(target.cpus))
            if fs.cpus(path) != target.cpus:
                tx.rollback()
                return False
        return True
    except cgroupfs.CgroupError:
        return False


def grow_ancestors(
    layout: cgroupfs.Layout, runtime_paths: Iterable[str], cpus: CPUSet
) -> list[str]:
    """cgroup v1: give back ``cpus`` (CPUs that came online) to every ancestor of these
    container cgroups that lacks them, top-down, where its parent has them - so that the
    runtime may later hand them to the container (a shared pool that grows when a neighbour
    stops).  The containers themselves are left alone.  Returns one line per failure."""
    if layout.version != cgroupfs.V1 or not cpus:
        return []
    errors: list[str] = []
    done: set[str] = set()
    with cgroupfs.CgroupFS(layout) as fs:
        for runtime_path in runtime_paths:
            try:
                parts = cgroupfs.split_path(cgroup_path(runtime_path))
            except cgroupfs.CgroupError as err:
                errors.append(str(err))
                continue
            parent_cpus: CPUSet | None = None  # the root follows the online CPUs by itself
            for depth in range(1, len(parts)):
                ancestor = cgroupfs.join(parts[:depth])
                try:
                    current = CPUSet.parse(fs.read("cpuset", ancestor, "cpuset.cpus"))
                    wanted = cpus if parent_cpus is None else cpus & parent_cpus
                    if ancestor not in done and not wanted <= current:
                        fs.write("cpuset", ancestor, "cpuset.cpus", str(current | wanted))
                        current |= wanted
                    done.add(ancestor)
                    parent_cpus = current
                except (cgroupfs.CgroupError, ValueError) as err:
                    errors.append(f"{ancestor}: {err}")
                    break
    return errors


def return_evicted_tasks(fs: cgroupfs.CgroupFS, path: str, proc: str = "/proc") -> int:
    """cgroup v1: move processes the kernel evicted from ``path``'s cpuset (or a cgroup below
    it) when it ran out of CPUs back where they belong.  Returns how many were moved."""
    parts = cgroupfs.split_path(path)
    moved = 0
    # The root is left out: it holds every host process, and the kernel only moves tasks there
    # when every ancestor is empty, which cannot happen to a pod below kubelet's cgroups.
    for depth in range(len(parts) - 1, 0, -1):
        ancestor = cgroupfs.join(parts[:depth])
        try:
            pids = fs.read("cpuset", ancestor, "cgroup.procs").split()
        except cgroupfs.CgroupError:
            continue
        for pid in pids:
            home = _witness_cgroup(proc, pid)
            if home is None or not (home == path or home.startswith(path + "/")):
                continue
            target = home if fs.exists("cpuset", home) else path
            try:
                fs.write("cpuset", target, "cgroup.procs", pid)
                moved += 1
            except cgroupfs.CgroupError as err:
                if err.code != "no-such-process":  # exited meanwhile: nothing to move
                    raise
    return moved


def _witness_cgroup(proc: str, pid: str) -> str | None:
    """The pid's cgroup in a v1 hierarchy that cpuset eviction does not touch."""
    if not pid.isdigit():
        return None
    try:
        with open(os.path.join(proc, pid, "cgroup")) as f:
            text = f.read(1 << 16)
    except OSError:
        return None
    found: dict[str, str] = {}
    for line in text.splitlines():
        _, controllers, where = [*line.split(":", 2), "", ""][:3]
        found[controllers] = where
    for controllers in _WITNESSES:
        if controllers in found:
            return found[controllers]
    return None
