"""A FAKE cgroup v1 mount: the cpuset and cpu hierarchies as plain files in a temporary
directory, below a generated sysfs tree (``<sysfs>/fs/cgroup``, where the daemon looks).

On cgroup v1 the daemon reads ``cpuset.cpus`` itself (no ``.effective`` to compute), so plain
files say what a container runs on.  The tree records who wrote each container's
``cpuset.cpus`` last: the runtime, systemd and the kernel write through this class (each write
remembered), the daemon through its real writer, straight into the files - a value nobody here
wrote is the daemon's.

What the FAKE does not do as the kernel would (and why that is enough for the model test):

* writes are never refused: v1's child-within-parent and online-only rules are not checked
  (a test that needs a refused write makes the cgroup unwritable, ``break_writes``);
* a runtime write drops CPUs that are offline, as the kernel would refuse them (v1) or leave
  them out of the effective set (v2); a set left empty keeps the old value;
* CPU hotplug: an offlined CPU leaves every cpuset (v1), a CPU coming online joins the root's
  only; tasks of a cpuset left empty are not evicted (the daemon's repair writes it again).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware.liveness import cgroup_path, pod_cgroup_path

CPUSET_FILES = {
    "cpuset.cpus": "",
    "cpuset.mems": "",
    "cgroup.procs": "",
    "cpuset.sched_load_balance": "1",
}
CPU_FILES = {
    "cpu.cfs_quota_us": "-1",
    "cpu.cfs_period_us": "100000",
    "cpu.shares": "1024",
    "cgroup.procs": "",
}
DAEMON = "daemon"


class FakeCgroupV1:
    """The FAKE mount below ``root`` (``<sysfs>/fs/cgroup``), its root cpuset on ``online``."""

    def __init__(self, root: Path, online: CPUSet, mems: str = "0") -> None:
        self.root = Path(root)
        self.online = online
        self.cpuset = self.root / "cpuset"
        self.cpu = self.root / "cpu"
        # cgroup path -> (who, value) of the last write made through this class
        self.last: dict[str, tuple[str, str]] = {}
        for hierarchy, files in ((self.cpuset, CPUSET_FILES), (self.cpu, CPU_FILES)):
            hierarchy.mkdir(parents=True)
            for name, value in files.items():
                (hierarchy / name).write_text(value + "\n")
        (self.cpuset / "cpuset.cpus").write_text(f"{online}\n")
        (self.cpuset / "cpuset.mems").write_text(f"{mems}\n")

    # --- paths ----------------------------------------------------------------------------------

    def _dirs(self, path: str) -> tuple[Path, Path]:
        rel = path.strip("/")
        return self.cpuset / rel, self.cpu / rel

    @staticmethod
    def container_path(runtime_path: str) -> str:
        """The cgroup path of a container's OCI cgroupsPath (either driver)."""
        return cgroup_path(runtime_path)

    @staticmethod
    def pod_path(cgroup_parent: str) -> str:
        return pod_cgroup_path(cgroup_parent)

    # --- cgroups --------------------------------------------------------------------------------

    def mk(self, path: str, cpus: CPUSet | None = None, mems: str | None = None,
           procs: str = "", quota: int = -1, shares: int = 1024) -> None:  # fmt: skip
        """Make a cgroup (and its missing ancestors, as kubelet and the runtime do), its cpuset
        copied from its parent when none is given (what v1 with ``cgroup.clone_children`` and
        runc do); offline CPUs left out."""
        parts = [p for p in path.strip("/").split("/") if p]
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            if not self.exists(ancestor):
                self.mk(ancestor)
        cpuset_dir, cpu_dir = self._dirs(path)
        parent = cpuset_dir.parent
        cpuset_dir.mkdir(exist_ok=True)
        cpu_dir.mkdir(parents=True, exist_ok=True)
        parent_cpus = (parent / "cpuset.cpus").read_text().strip()
        parent_mems = (parent / "cpuset.mems").read_text().strip()
        usable = cpus & self.online if cpus else None
        files = {
            "cpuset.cpus": str(usable) if usable else parent_cpus,
            "cpuset.mems": mems or parent_mems,
            "cgroup.procs": procs,
            "cpuset.sched_load_balance": "1",
        }
        for name, value in files.items():
            (cpuset_dir / name).write_text(value + "\n")
        cpu_files = {
            "cpu.cfs_quota_us": str(quota),
            "cpu.cfs_period_us": "100000",
            "cpu.shares": str(shares),
            "cgroup.procs": procs,
        }
        for name, value in cpu_files.items():
            (cpu_dir / name).write_text(value + "\n")
        self.last[path] = ("runtime", files["cpuset.cpus"])

    def exists(self, path: str) -> bool:
        return self._dirs(path)[0].is_dir()

    def remove(self, path: str) -> None:
        """The cgroup and everything below it go (the runtime deleting a task, kubelet a pod)."""
        for directory in self._dirs(path):
            shutil.rmtree(directory, ignore_errors=True)
        for known in [p for p in self.last if p == path or p.startswith(path.rstrip("/") + "/")]:
            del self.last[known]

    def read(self, path: str, name: str = "cpuset.cpus") -> str:
        hierarchy = 1 if name.startswith("cpu.") else 0
        return (self._dirs(path)[hierarchy] / name).read_text().strip()

    def cpus(self, path: str) -> CPUSet | None:
        """What the cgroup runs on; None when it does not exist."""
        try:
            return CPUSet.parse(self.read(path))
        except (OSError, ValueError):
            return None

    def writer_of(self, path: str) -> str | None:
        """Who wrote the cgroup's ``cpuset.cpus`` last: "runtime", "systemd", "kernel", or
        "daemon" (a value none of those wrote); None when the cgroup does not exist."""
        try:
            now = self.read(path)
        except OSError:
            return None
        who, value = self.last.get(path, (DAEMON, None))
        return who if value == now else DAEMON

    # --- writes by someone other than the daemon --------------------------------------------

    def write(self, who: str, path: str, cpus: CPUSet | None = None, mems: str | None = None,
              quota: int | None = None) -> bool:  # fmt: skip
        """Write what is given, in place (the daemon may keep the file open), as ``who``;
        offline CPUs are dropped (see the module text).  False when the cgroup is gone or the
        write is refused."""
        cpuset_dir, cpu_dir = self._dirs(path)
        if not cpuset_dir.is_dir():
            return False
        try:
            if mems:
                _rewrite(cpuset_dir / "cpuset.mems", mems)
            if cpus is not None:
                usable = cpus & self.online
                if not usable:
                    return False
                _rewrite(cpuset_dir / "cpuset.cpus", str(usable))
                self.last[path] = (who, str(usable))
            if quota is not None and cpu_dir.is_dir():
                _rewrite(cpu_dir / "cpu.cfs_quota_us", str(quota))
        except OSError:
            return False
        return True

    def break_writes(self, path: str) -> None:
        """Make the cgroup's ``cpuset.cpus`` impossible to open or write (a directory in its
        place): as a cgroup the kernel refuses to change, for the writer that opens the file."""
        target = self._dirs(path)[0] / "cpuset.cpus"
        target.unlink()
        target.mkdir()

    # --- CPU hotplug (the kernel) -----------------------------------------------------------

    def offline(self, cpu: int) -> None:
        """v1: the CPU leaves every cpuset."""
        self.online = self.online - CPUSet([cpu])
        for path, directory in self._cpusets():
            try:
                now = CPUSet.parse((directory / "cpuset.cpus").read_text())
            except (OSError, ValueError):
                continue
            if cpu in now:
                _rewrite(directory / "cpuset.cpus", str(now - CPUSet([cpu])))
                self.last[path] = ("kernel", str(now - CPUSet([cpu])))

    def online_again(self, cpu: int) -> None:
        """v1: the CPU joins the root cpuset only."""
        self.online = self.online | CPUSet([cpu])
        _rewrite(self.cpuset / "cpuset.cpus", str(self.online))

    def _cpusets(self) -> list[tuple[str, Path]]:
        found = []
        for directory, _, files in os.walk(self.cpuset):
            if "cpuset.cpus" in files:
                rel = "/" + str(Path(directory).relative_to(self.cpuset)).strip(".")
                found.append((rel.rstrip("/") or "/", Path(directory)))
        return found


def _rewrite(file: Path, value: str) -> None:
    """Write in place, as ``echo value > file`` (the same inode: a descriptor kept open by the
    daemon still names it)."""
    fd = os.open(file, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)
