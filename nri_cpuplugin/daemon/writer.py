"""How the daemon's targets reach containers' cgroups without the runtime.

Each target the runtime applies costs it a ``runc update``, run one after another while other
pods wait; a direct write is one file write (a few microseconds through a file kept open).  So
the node writes what it can here, and only what this writer cannot write goes into a reply or
is owed to the next one (docs/architecture.md, "Shared containers on dense nodes").

This writer serves containers of the cgroupfs driver.  A container of the systemd driver is a
unit whose cpuset systemd re-applies from the unit's properties (``daemon-reload``) while it
holds one: written only behind systemd's back it would move back, so it is left to the runtime
unless ``units`` can make systemd hold none (daemon/units.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Protocol

from ..core.cpuset import CPUSet
from ..core.outcome import Target
from ..hardware import cgroupfs, cpusets
from ..hardware.cpuset_files import OpenCpusets
from ..hardware.liveness import Liveness, cgroup_path
from ..ops.audit import Audit


class Units(Protocol):
    """Changes the cpusets of systemd units the way systemd keeps them."""

    def set_cpus(self, targets: list[cpusets.Target]) -> list[str]:
        """Returns the ids of the targets that could not be set."""

    def take_refused(self) -> list[str]:
        """The ids of targets systemd refused after ``set_cpus`` had returned, each told once."""

    def finish(self) -> list[str]:
        """Follow up what earlier ``set_cpus`` left unconfirmed; the ids now the runtime's."""

    def forget(self, container_id: str) -> None:
        """The runtime gives the container's unit a cpuset now, or the container is gone."""

    def keep_only(self, container_ids: set[str]) -> None:
        """Forget every container but these."""


class CgroupWriter:
    def __init__(self, liveness: Liveness, audit: Audit, units: Units | None = None) -> None:
        self.liveness = liveness
        self.audit = audit
        self.units = units
        # Shared containers whose cgroup asks for no scheduler domain of its own any more,
        # which halves the cost of each write (hardware/cpusets.stop_balancing), and whose
        # cpuset.cpus is kept open (hardware/cpuset_files.py): see ``prepare_shared``.
        self._unbalanced: set[str] = set()
        self._files = OpenCpusets()
        self.proc = "/proc"

    def can_write(self, runtime_path: str) -> bool:
        """Whether a target at this cgroupsPath is written here (else the runtime applies it)."""
        if not runtime_path or self.liveness.layout() is None:
            return False
        return is_cgroupfs_path(runtime_path) or self.units is not None

    def why_not(self, runtime_path: str) -> str:
        """What makes a cgroupsPath one this writer cannot write (or did not), as a message
        says it."""
        if not runtime_path:
            return "no cgroup path"
        if self.liveness.layout() is None:
            return f"the cgroup {runtime_path!r}, and no cgroup filesystem is mounted here"
        if self.can_write(runtime_path):  # it can be written, but was not
            return f"the cgroup {runtime_path!r}, whose write failed"
        return (
            f"the systemd cgroup driver's unit {runtime_path!r}, and no connection to "
            "systemd to change its properties (a direct write would be undone by systemd)"
        )

    def write(self, targets: Iterable[cpusets.Target]) -> list[str]:
        """Write each target; returns the ids of those the runtime must apply after all (no
        cgroup path, another driver, or a write that failed)."""
        runtime: list[str] = []
        direct: list[cpusets.Target] = []
        for target in targets:
            if self.can_write(target.runtime_path):
                direct.append(target)
            else:
                runtime.append(target.container_id)
        if not direct:
            return runtime
        # the files first: they hold the cpusets at once, whatever systemd takes to answer
        failed = self._write_files(direct)
        failed |= self._set_units(direct)
        return runtime + [t.container_id for t in direct if t.container_id in failed]

    def _set_units(self, targets: list[cpusets.Target]) -> set[str]:
        """The systemd-driver ones' unit properties; the ids systemd did not take."""
        units = [self._with_mems(t) for t in targets if not is_cgroupfs_path(t.runtime_path)]
        if self.units is None or not units:
            return set()
        return set(self.units.set_cpus(units))

    def take_refused(self) -> list[str]:
        """Containers systemd refused after ``write`` had returned: the runtime's to apply."""
        return self.units.take_refused() if self.units is not None else []

    def finish_units(self) -> list[str]:
        """Finish what systemd left unconfirmed (daemon/units.py); the containers that are
        the runtime's to apply after all."""
        return self.units.finish() if self.units is not None else []

    def _write_files(self, targets: list[cpusets.Target]) -> set[str]:
        """The cgroup files; the ids whose write failed.  Most of them (a creation on a dense
        node: every shared container) go through the files kept open since they started; the
        others, and a target with memory nodes or a quota to set, through cpusets.move."""
        layout = self.liveness.layout()
        assert layout is not None  # can_write
        plain = {
            t.container_id: t.cpus
            for t in targets
            if t.mems is None and t.quota is None and not t.mems_from_parent
        }
        left = set(self._files.write_kept(plain.items()))
        general = [t for t in targets if t.container_id in left or t.container_id not in plain]
        return set(cpusets.move(layout, general, self._unbalanced, self._files).failed)

    def _with_mems(self, target: cpusets.Target) -> cpusets.Target:
        """A unit's memory nodes as a list: systemd takes an empty AllowedMemoryNodes as "no
        restriction" and leaves the old, narrower set in place."""
        if target.mems_from_parent and not target.mems:
            return target.evolve(mems=self._parent_mems(target.runtime_path))
        return target

    def write_own(self, target: cpusets.Target) -> list[str]:
        """Write a container's own cgroup before its first instruction (its cpuset, and an
        exclusive one's memory nodes and quota): one line per error."""
        layout = self.liveness.layout()
        if layout is None:
            return ["no cgroup filesystem found"]
        if not self.can_write(target.runtime_path):
            return [f"its cgroup {target.runtime_path!r} is not one this daemon writes"]
        errors = cpusets.move(layout, [target], self._unbalanced, self._files).errors
        if self._set_units([target]):
            errors.append(f"systemd did not take the CPUs of {target.runtime_path!r}")
        return errors

    def for_runtime(self, target: Target, runtime_path: str) -> Target:
        """``target`` as a reply carries it: the runtime writes this cgroup now, so what we
        last wrote there no longer says what is; a target that gives a container its parent's
        memory nodes names them (the runtime has no such notion)."""
        self.runtime_wrote(target.container_id)
        if target.mems_from_parent and not target.mems:
            target = target.evolve(mems=self._parent_mems(runtime_path))
        return target

    def runtime_wrote(self, container_id: str) -> None:
        """The runtime has written (or is given to write) the container's cpuset: what we last
        wrote there no longer says what is, and the systemd driver's unit holds a cpuset
        again (runc sets it)."""
        self._files.written_elsewhere(container_id)
        if self.units is not None:
            self.units.forget(container_id)

    def _parent_mems(self, runtime_path: str) -> CPUSet | None:
        """The memory nodes of the container's parent cgroup (its pod's), or - when its cgroup
        is unknown - the root cpuset's (kubelet restricts no pod's nodes without its memory
        manager); None, which leaves them as they are, when neither can be read."""
        layout = self.liveness.layout()
        if layout is None:
            return None
        try:
            with cgroupfs.CgroupFS(layout) as fs:
                if runtime_path:
                    return fs.parent_mems(cgroup_path(runtime_path)) or None
                name = "cpuset.mems.effective" if layout.version == cgroupfs.V2 else "cpuset.mems"
                return CPUSet.parse(fs.read("cpuset", "/", name)) or None
        except (cgroupfs.CgroupError, ValueError):
            return None

    def prepare_shared(self, container_id: str, runtime_path: str) -> None:
        """Make a shared container's cgroup quick to write when an exclusive container comes
        (cgroup v1; once per container): no scheduler domain of its own, and its
        ``cpuset.cpus`` kept open."""
        layout = self.liveness.layout()
        if layout is None or not is_cgroupfs_path(runtime_path):
            return
        if container_id not in self._unbalanced or container_id not in self._files:
            with cgroupfs.CgroupFS(layout) as fs:
                cpusets.stop_balancing(fs, [(container_id, runtime_path)], self._unbalanced)
                self._files.open(fs, container_id, cgroup_path(runtime_path))

    def forget(self, container_id: str) -> None:
        """Drop what ``prepare_shared`` holds for a container that is gone."""
        self._unbalanced.discard(container_id)
        self._files.forget(container_id)
        if self.units is not None:
            self.units.forget(container_id)

    def keep_only(self, container_ids: set[str]) -> None:
        self._unbalanced &= container_ids
        self._files.keep_only(container_ids)
        if self.units is not None:
            self.units.keep_only(container_ids)

    def grow_ancestors(self, runtime_paths: Iterable[str], cpus: CPUSet) -> None:
        """Give CPUs that came back online to the ancestors of these cgroups (cgroup v1 gives
        such a CPU to no cpuset made while it was offline; a no-op on v2)."""
        layout = self.liveness.layout()
        if layout is not None:
            errors = cpusets.grow_ancestors(layout, runtime_paths, cpus)
            self.audit.emit(cpusets.repair_events({}, errors))

    def repair(
        self, targets: list[cpusets.Target], tracked_paths: Iterable[str], grow: CPUSet
    ) -> list[str]:
        """After the online CPUs changed: ``grow`` given back to the ancestors of every tracked
        cgroup, then each target written with its quota, and tasks the kernel evicted put
        back (cgroup v1); one line per error."""
        self._files.written_elsewhere()
        try:
            layout = cgroupfs.detect(self.liveness.root)
        except cgroupfs.CgroupError as err:
            self.audit.emit(cpusets.repair_events({}, [str(err)]))
            return [str(err)]
        errors = cpusets.grow_ancestors(layout, sorted(set(tracked_paths)), grow)
        returned: dict[str, int] = {}
        if targets:
            applied = cpusets.apply(layout, targets, self.proc)
            errors += applied.errors
            returned = applied.returned
        self.audit.emit(cpusets.repair_events(returned, errors))
        return errors

    def return_evicted(self, targets: Iterable[tuple[str, str]]) -> None:
        """(container id, cgroupsPath): put back tasks cgroup v1 evicted from these cgroups."""
        layout = self.liveness.layout()
        if layout is None or layout.version != cgroupfs.V1:
            return
        with cgroupfs.CgroupFS(layout) as fs:
            for cid, runtime_path in targets:
                with contextlib.suppress(cgroupfs.CgroupError):
                    path = cgroup_path(runtime_path)
                    moved = cpusets.return_evicted_tasks(fs, path, self.proc)
                    if moved:
                        self.audit.emit(cpusets.repair_events({cid: moved}, []))


def is_cgroupfs_path(path: str) -> bool:
    """A cgroupsPath of the cgroupfs driver (the systemd driver's is slice:prefix:name)."""
    return bool(path) and (path.startswith("/") or path.count(":") != 2)
