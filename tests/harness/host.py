"""Reading the host's truth for e2e assertions: cgroups, mounts, processes, CPUs.

The runtime's own answers (CRI status, even the OCI spec) say what was *asked*; these helpers
read what the kernel actually applied, which is what the tests must check.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

_V1_CONTROLLERS = frozenset(
    {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "net_cls"}
    | {"net_prio", "perf_event", "hugetlb", "rdma", "misc"}
)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mountinfo() -> list[tuple[str, str, str]]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split()[:3]
        out.append((_unescape(left.split()[4]), fstype, options))
    return out


def mounts() -> list[tuple[str, str]]:
    """``(mount point, fs type)`` of every mount in our mount namespace, in mount order."""
    return [(point, fstype) for point, fstype, _ in _mountinfo()]


def mount_options_under(*roots: Path | str) -> list[tuple[str, str, str]]:
    """``(mount point, fs type, superblock options)`` of the mounts at or below ``roots``; an
    overlay's options name its lowerdir, upperdir and workdir."""
    return [m for m in _mountinfo() if is_under(m[0], *roots)]


def mounts_under(*roots: Path | str) -> list[str]:
    """Mount points at or below any of ``roots``."""
    return [p for p, _ in mounts() if is_under(p, *roots)]


def is_under(path: str | Path, *roots: Path | str) -> bool:
    path = str(path)
    return any(path == str(r) or path.startswith(f"{r}/") for r in roots)


def cgroup_hierarchies() -> dict[str, Path]:
    """Controller (``cpuset``, ``memory``, ``name=systemd``; ``unified`` for cgroup2) -> mount
    point of each hierarchy.  On a hybrid host every v1 hierarchy *and* the unified one hold
    their own copy of each cgroup path."""
    found: dict[str, Path] = {}
    for point, fstype, options in _mountinfo():
        if fstype == "cgroup2":
            found.setdefault("unified", Path(point))
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in _V1_CONTROLLERS or opt.startswith("name="):
                    found.setdefault(opt, Path(point))
    return found


def cgroup_dir(cgroup_path: str, controller: str = "cpuset") -> Path:
    """Host directory of a cgroupfs path (e.g. a container's ``cgroupsPath``)."""
    hierarchies = cgroup_hierarchies()
    if controller not in hierarchies:
        raise LookupError(f"no cgroup hierarchy for {controller!r}; have {sorted(hierarchies)}")
    return hierarchies[controller] / cgroup_path.lstrip("/")


def remove_cgroup(cgroup_path: str) -> None:
    """Remove a cgroupfs path from every hierarchy it is in (as kubelet removes a pod's cgroup
    once the pod is gone); one still in use (EBUSY) or already gone is left as it is."""
    for mount in set(cgroup_hierarchies().values()):
        directory = mount / cgroup_path.lstrip("/")
        try:
            directory.rmdir()
        except OSError:
            continue


def read_cgroup(cgroup_path: str, file: str, controller: str | None = None) -> str:
    """One cgroup file's content, stripped; the controller defaults to the file's prefix
    (``cpuset.cpus`` -> cpuset)."""
    return (cgroup_dir(cgroup_path, controller or file.split(".")[0]) / file).read_text().strip()


def proc_cgroups(pid: int) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as controller -> path (``unified`` for the ``0::`` line)."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else ["unified"]:
            out[c] = path
    return out


def cpus_allowed_list(pid: int) -> str:
    """The kernel's affinity of ``pid`` (``Cpus_allowed_list`` of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise LookupError(f"no Cpus_allowed_list for pid {pid}")


def parse_cpu_list(text: str) -> list[int]:
    """Linux list format (``0-2,5``), or systemd's (``0-2 5``) -> sorted CPU numbers."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().replace(" ", ",").split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def online_cpus() -> list[int]:
    return parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text())


def start_time(pid: int) -> int | None:
    """Process start time in clock ticks (field 22 of /proc/pid/stat); ``(pid, start_time)``
    names a process uniquely even after pid reuse.  None when the pid does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def is_alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` is a running (not zombie) process, and the same one if ``started`` given."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    if fields[0] in ("Z", "X"):
        return False
    return started is None or int(fields[19]) == started


def cmdline(pid: int) -> bytes:
    """Raw ``/proc/<pid>/cmdline`` (NUL-separated); empty for kernel threads, zombies, gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def unix_socket_paths(pid: int) -> list[str]:
    """Filesystem paths of the listening or connected unix sockets ``pid`` holds open."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    paths = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
                paths.append(parts[7])
    return sorted(set(paths))


def pids() -> list[int]:
    return sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
