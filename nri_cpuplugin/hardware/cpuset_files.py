"""The ``cpuset.cpus`` files of shared containers' cgroups, kept open between writes (cgroup v1).

Creating an exclusive container writes every shared container's cgroup before the runtime is
answered (daemon/creation.py), so on a dense node these writes are in the creation's critical
path.  Most of a write's cost is getting to the file: one confined open per path component
(``kubepods/<qos>/pod<uid>/<container>``, never following a link), then the file itself.  With
the file kept open, a write is one ``fstat`` of the kept directory (its link count says whether
cgroups were nested below it since: then the general path, hardware/cpusets.apply, takes over)
and one write at offset 0: about 3 us instead of 8.5 us on this project's test machine, and no
directory walk on a cold cache.  Only a write that adds CPUs needs the ``fstat``: cgroup v1
passes a parent's growth to no child, so a nested cgroup must be grown by the general path.
Taking CPUs away (an exclusive creation's writes, the ones it waits for) is refused by the
kernel itself (EBUSY) while a child still uses them, and the general path takes over the same
way.

cgroup v1 only: on cgroup v2 the kernel never refuses a set, and each write's effect must be
read back, which the general path does anyway.  On the kernel's cgroup filesystem a write
replaces the value whatever the offset; a look-alike tree of plain files (tests) is truncated
first.

An open file stays bound to the cgroup it was opened in: once that cgroup is removed, writes
fail (ENODEV) and the entry is dropped.  Entries are dropped too when the container is removed
and, at a Synchronize, for containers the runtime no longer lists.  At most ``limit``
containers keep their files open (by default an eighth of the process's descriptor limit, two
descriptors each); a write for any other opens its file as usual."""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Iterable

from ..core.cpuset import CPUSet
from . import cgroupfs

FILE = "cpuset.cpus"
CGROUP_FILESYSTEMS = ("cgroup", "cgroup2")


def default_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (4096 if soft == resource.RLIM_INFINITY else soft) // 8


class OpenCpusets:
    """Container id -> its cgroup directory and ``cpuset.cpus``, open (see the module text)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = default_limit() if limit is None else limit
        self._open: dict[str, tuple[int, int]] = {}  # container id -> (directory, file)
        self._written: dict[str, CPUSet] = {}  # container id -> the set last written here
        self._plain: bool | None = None  # files outside a cgroup mount: set at the first open
        # The same set goes to every shared container: its text is made once.
        self._last: tuple[CPUSet, bytes] = (CPUSet(), b"\n")

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, container_id: str) -> bool:
        return container_id in self._open

    def open(self, fs: cgroupfs.CgroupFS, container_id: str, path: str) -> bool:
        """Keep the container's cgroup open (cgroup v1, below the limit); whether it is."""
        if container_id in self._open:
            return True
        if fs.layout.version == cgroupfs.V2 or len(self._open) >= self.limit:
            return False
        try:
            directory = fs.open("cpuset", path, ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except cgroupfs.CgroupError:
            return False
        try:
            file = os.open(FILE, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        except OSError:
            os.close(directory)
            return False
        self._open[container_id] = (directory, file)
        if self._plain is None:
            self._plain = mount_type(fs.layout.cpuset_root) not in CGROUP_FILESYSTEMS
        return True

    def write(self, fs: cgroupfs.CgroupFS, container_id: str, path: str, cpus: CPUSet) -> bool:
        """Write ``cpus`` through the kept file, opening it first if need be.  False when no
        file can be kept or cgroups are nested below (the caller takes another path); raises
        CgroupError when the write itself failed (the kernel refused the set, or the cgroup is
        gone), and the entry is dropped."""
        if not self.open(fs, container_id, path):
            return False
        return self._write(container_id, path, cpus)

    def write_kept(self, targets: Iterable[tuple[str, CPUSet]]) -> list[str]:
        """Write each (container id, cpus) whose files are kept open, with nothing else on
        the way (the common case, and the one a creation waits for); returns the ids left to
        the caller: no kept file, cgroups nested below, or the write failed."""
        left = []
        for container_id, cpus in targets:
            try:
                if container_id in self._open and self._write(container_id, container_id, cpus):
                    continue
            except cgroupfs.CgroupError:
                pass
            left.append(container_id)
        return left

    def _write(self, container_id: str, where: str, cpus: CPUSet) -> bool:
        directory, file = self._open[container_id]
        last, data = self._last
        if cpus != last:
            data = f"{cpus}\n".encode()
            self._last = (cpus, data)
        before = self._written.get(container_id)
        # A look-alike tree of plain files refuses nothing: it is always checked.
        grows = self._plain or before is None or not cpus <= before
        try:
            if grows and os.fstat(directory).st_nlink > 2:  # "." and ".." only in a leaf
                self.written_elsewhere(container_id)  # by the general path
                return False
            if self._plain:
                os.ftruncate(file, 0)
            written = os.pwrite(file, data, 0)
        except OSError as err:
            if err.errno == errno.EBUSY:  # a nested cgroup still uses CPUs taken away
                self.written_elsewhere(container_id)
                return False
            self.forget(container_id)
            gone = " (the cgroup was removed)" if err.errno == errno.ENODEV else ""
            raise cgroupfs.CgroupError(
                f"writing {cpus} to {where}/{FILE} failed: {err.strerror}{gone}"
            ) from None
        if written != len(data):
            self.forget(container_id)
            raise cgroupfs.CgroupError(f"short write of {cpus} to {where}/{FILE}")
        self._written[container_id] = cpus
        return True

    def written_elsewhere(self, container_id: str | None = None) -> None:
        """Someone else writes the container's cpuset (the runtime, applying an update; the
        general path, hardware/cpusets.apply), or every container's (None: CPU hotplug, where
        the kernel and the general path write): the next write through the kept file is
        checked as one that adds CPUs.  A set left stale would only make a growth look like a
        shrink and leave a nested cgroup short of CPUs, never give one CPUs it must not have."""
        if container_id is None:
            self._written.clear()
        else:
            self._written.pop(container_id, None)

    def forget(self, container_id: str) -> None:
        self.written_elsewhere(container_id)
        for fd in self._open.pop(container_id, ()):
            os.close(fd)

    def keep_only(self, container_ids: set[str] | dict[str, object]) -> None:
        for cid in [c for c in self._open if c not in container_ids]:
            self.forget(cid)

    def close(self) -> None:
        for cid in list(self._open):
            self.forget(cid)


def mount_type(mount_point: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The filesystem type mounted at ``mount_point`` (the last such mount), or None."""
    found = None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4] == mount_point and " - " in line:
                    found = line.split(" - ", 1)[1].split()[0]
    except OSError:
        return None
    return found
