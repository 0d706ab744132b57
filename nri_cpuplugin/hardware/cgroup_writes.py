"""Writing a container's cpuset and CFS quota through cgroupfs.py's confined access: ordered,
checked, and all or nothing (docs/cgroups-and-hooks.md §10, §11).

* Ordering.  cgroup v1 enforces child ⊆ parent at write time (EACCES) and refuses to shrink a
  parent below a child (EBUSY), so sets grow top-down and shrink bottom-up, and ``cpuset.mems``
  is written before ``cpuset.cpus``.  cgroup v2 accepts any write and silently falls back to the
  parent's CPUs when nothing overlaps, so every write is verified by reading
  ``cpuset.cpus.effective`` / ``cpuset.mems.effective`` back.
* All or nothing.  Writes go through a :class:`Transaction` that remembers each file's previous
  content; if a later write fails, the earlier ones are undone in reverse order, so a failed
  hook does not leave a half-moved node behind.
"""

from __future__ import annotations

from ..core.cpuset import CPUSet
from .cgroupfs import V2, CgroupError, CgroupFS, join, split_path


class Transaction:
    """Writes that are undone, newest first, if the sequence does not complete.

    ``with Transaction(fs) as tx:`` rolls back when the block raises; ``rollback_errors`` then
    says what could not be restored (the caller reports it)."""

    def __init__(self, fs: CgroupFS) -> None:
        self.fs = fs
        self.done: list[tuple[str, str, str, str]] = []  # (controller, path, file, old value)
        self.rollback_errors: list[str] = []

    def write(self, controller: str, path: str, name: str, value: str) -> None:
        old = self.fs.read(controller, path, name)
        self.fs.write(controller, path, name, value)
        self.done.append((controller, path, name, old))

    def rollback(self) -> list[str]:
        errors = []
        for controller, path, name, old in reversed(self.done):
            try:
                self.fs.write(controller, path, name, old)
            except CgroupError as err:
                errors.append(str(err))
        self.done.clear()
        self.rollback_errors = errors
        return errors

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.rollback()


# --- cpusets ---------------------------------------------------------------------------------


def set_cpuset(
    tx: Transaction,
    path: str,
    cpus: CPUSet,
    mems: CPUSet | None = None,
    mems_from_parent: bool = False,
) -> bool:
    """Make the container cgroup ``path`` (and anything nested below it) run on ``cpus`` and,
    if given, allocate from NUMA nodes ``mems`` - or, with ``mems_from_parent``, from every
    node its parent cgroup may use (what a container made without memory nodes gets).
    Returns whether anything was written.

    Ancestors are only ever grown (top-down) to make room; they belong to the pod and kubelet,
    and other containers live below them."""
    if not cpus:
        raise CgroupError(f"refusing to give cgroup {path} an empty cpuset")
    changed = False
    if mems_from_parent and not mems:
        mems = tx.fs.parent_mems(path)
    if mems:
        changed |= _apply(tx, path, "cpuset.mems", mems)
    changed |= _apply(tx, path, "cpuset.cpus", cpus)
    return changed


def _apply(tx: Transaction, path: str, name: str, target: CPUSet) -> bool:
    """Write ``name`` (cpuset.cpus or cpuset.mems) of container cgroup ``path``: its ancestors
    grown, its subtree set, and on v2 what the kernel applied checked.  Whether anything was
    written."""
    parts = split_path(path)
    if not parts:
        raise CgroupError("refusing to write the root cgroup")
    changed = _grow_ancestors(tx, parts, name, target)
    changed |= _set_subtree(tx, path, name, target)
    if tx.fs.layout.version == V2:
        _check_applied(tx.fs, path, name, target)
    return changed


def _grow_ancestors(tx: Transaction, parts: tuple[str, ...], name: str, target: CPUSet) -> bool:
    """Step 1: ancestors, top-down, grown where they lack part of the target.  In v2 an empty
    value means "inherit", which already contains whatever the parent has."""
    fs = tx.fs
    v2 = fs.layout.version == V2
    changed = False
    for depth in range(1, len(parts)):
        ancestor = join(parts[:depth])
        current = fs.read_set(ancestor, name)
        if (current or not v2) and not target <= current:
            tx.write("cpuset", ancestor, name, str(current | target))
            changed = True
    return changed


def _set_subtree(tx: Transaction, path: str, name: str, target: CPUSet) -> bool:
    """Step 2: the container's subtree: grown top-down where needed, then shrunk bottom-up,
    so that every intermediate state satisfies v1's child ⊆ parent.  Usually the subtree is
    the container alone, and this is a single write."""
    fs = tx.fs
    v2 = fs.layout.version == V2
    subtree = fs.subtree("cpuset", path)
    values = {p: fs.read_set(p, name) for p in subtree}
    changed = False
    if len(subtree) > 1 and not v2:
        for node in subtree:
            if not target <= values[node]:
                values[node] = values[node] | target
                tx.write("cpuset", node, name, str(values[node]))
                changed = True
    for node in reversed(subtree):
        if v2 and node != path and not values[node]:
            continue  # inherits the container's set already
        if values[node] != target:
            tx.write("cpuset", node, name, str(target))
            changed = True
    return changed


def _check_applied(fs: CgroupFS, path: str, name: str, target: CPUSet) -> None:
    """Step 3, v2: it never refuses a write; it just applies something else."""
    effective = f"{name}.effective"
    applied = fs.read_set(path, effective)
    if applied != target:
        raise CgroupError(
            f"cgroup {path}: wrote {name}={target or '(empty)'} but the kernel applied "
            f"{applied or '(empty)'} ({effective}); an ancestor does not offer those "
            f"{'CPUs' if name.endswith('cpus') else 'memory nodes'}"
        )


# --- CFS quota -------------------------------------------------------------------------------


def lift_quota(tx: Transaction, cpu_path: str) -> bool:
    """No CFS quota for the container (exclusive CPUs bound it already; quota only adds
    throttling).  v1 ``cpu.cfs_quota_us = -1``; v2 ``cpu.max = max <period>``."""
    fs = tx.fs
    if fs.layout.version == V2:
        current = fs.read("cpu", cpu_path, "cpu.max").split()
        if not current or current[0] == "max":
            return False
        period = current[1] if len(current) > 1 else "100000"
        tx.write("cpu", cpu_path, "cpu.max", f"max {period}")
        return True
    if fs.read("cpu", cpu_path, "cpu.cfs_quota_us") == "-1":
        return False
    tx.write("cpu", cpu_path, "cpu.cfs_quota_us", "-1")
    return True


def limit_quota(tx: Transaction, cpu_path: str, quota_us: int, period_us: int = 100_000) -> bool:
    """Put a CFS quota back (a degraded exclusive container that runs in the shared pool is
    bounded by its CPU limit again).  v1 ``cpu.cfs_quota_us``; v2 ``cpu.max``."""
    fs = tx.fs
    if fs.layout.version == V2:
        want = f"{quota_us} {period_us}"
        if fs.read("cpu", cpu_path, "cpu.max") == want:
            return False
        tx.write("cpu", cpu_path, "cpu.max", want)
        return True
    if fs.read("cpu", cpu_path, "cpu.cfs_quota_us") == str(quota_us):
        return False
    tx.write("cpu", cpu_path, "cpu.cfs_quota_us", str(quota_us))
    return True
