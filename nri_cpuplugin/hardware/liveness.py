"""Is a container still running?  Asked of its cgroup when the runtime cannot tell us.

containerd 1.7 does not resend the state to a plugin it launched (no Synchronize), and after a
containerd restart it does not report the stop of containers created before the restart
(docs/nri-wire.md §5.2, §9.3).  A plugin that only listened would keep their CPUs forever, so
while unsynchronized the plugin checks its assignments against the cgroups: a container whose
cgroup is gone, or holds no process, has ended.
"""

from __future__ import annotations

from ..core.cpuset import CPUSet
from ..core.workload import GUARANTEED, SHARES_PER_CPU, qos_from_cgroup_parent
from . import cgroupfs

SYSTEMD_SUFFIX = ".slice"


def cgroup_path(runtime_path: str) -> str:
    """The cgroup path, relative to the hierarchy root, of an OCI ``cgroupsPath``.

    cgroupfs driver: the path itself.  systemd driver: ``slice:prefix:name`` is the unit
    ``prefix-name.scope`` below the slice, whose own path spells out every parent slice
    (``kubepods-burstable-pod1.slice`` lives in ``kubepods.slice/kubepods-burstable.slice``;
    docs/cgroups-and-hooks.md §6).
    """
    if runtime_path.count(":") != 2 or runtime_path.startswith("/"):
        return runtime_path
    slice_name, prefix, name = runtime_path.split(":")
    unit = f"{prefix}-{name}.scope" if prefix else f"{name}.scope"
    return "/" + "/".join([*_slices(slice_name), unit])


def pod_cgroup_path(cgroup_parent: str) -> str:
    """The cgroup path of a pod, from its sandbox's cgroup parent: a path (cgroupfs driver) or
    a slice name (systemd driver: ``kubepods-pod1.slice`` is ``/kubepods.slice/kubepods-pod1
    .slice``)."""
    if cgroup_parent.startswith("/") or not cgroup_parent.endswith(SYSTEMD_SUFFIX):
        return cgroup_parent
    return "/" + "/".join(_slices(cgroup_parent))


def _slices(slice_name: str) -> list[str]:
    """A slice and every slice above it, outermost first (the root slice ``-.slice`` is the
    hierarchy's root)."""
    if not slice_name or slice_name == "-.slice":
        return []
    pieces = slice_name.removesuffix(SYSTEMD_SUFFIX).split("-")
    return ["-".join(pieces[: i + 1]) + SYSTEMD_SUFFIX for i in range(len(pieces))]


class Liveness:
    """Checks containers' cgroups below one cgroup mount (v1 cpuset hierarchy or v2)."""

    def __init__(self, root: str = cgroupfs.DEFAULT_ROOT) -> None:
        self.root = root
        self._layout: cgroupfs.Layout | None = None

    def layout(self) -> cgroupfs.Layout | None:
        """The cgroup hierarchy below ``root``; None when there is none (a generated sysfs
        tree in tests, a missing mount): nothing to read or write then.  Found once (about
        60 us of path lookups, on every event that touches a cgroup otherwise): a node does
        not change its cgroup mounts under a running daemon.  Not finding one is not kept."""
        if self._layout is None:
            try:
                self._layout = cgroupfs.detect(self.root)
            except cgroupfs.CgroupError:
                return None
        return self._layout

    def cpus(self, runtime_path: str) -> CPUSet | None:
        """What the container's cgroup says it runs on; None when that cannot be read."""
        layout = self.layout() if runtime_path else None
        if layout is None:
            return None
        try:
            with cgroupfs.CgroupFS(layout) as fs:
                return fs.cpus(cgroup_path(runtime_path))
        except cgroupfs.CgroupError:
            return None

    def pod_gone(self, cgroup_parent: str) -> bool:
        """Whether the pod's cgroup is gone (kubelet removes it with the pod); False when that
        cannot be told."""
        layout = self.layout() if cgroup_parent else None
        if layout is None:
            return False
        try:
            path = pod_cgroup_path(cgroup_parent)
            cgroupfs.split_path(path)
            with cgroupfs.CgroupFS(layout) as fs:
                return not fs.exists("cpuset", path)
        except cgroupfs.CgroupError:
            return False

    def alive(self, runtime_path: str) -> bool | None:
        """True/False when the cgroup says so; None when it cannot be told (no path, odd
        path, unreadable mount): the caller must then keep what it has."""
        layout = self.layout() if runtime_path else None
        if layout is None:
            return None
        try:
            with cgroupfs.CgroupFS(layout) as fs:
                path = cgroup_path(runtime_path)
                cgroupfs.split_path(path)  # a malformed path says nothing about liveness
                if not fs.exists("cpuset", path):
                    return False
                return fs.populated(path)
        except cgroupfs.CgroupError:
            return None


# A real node has a few hundred pod cgroups; a tree far larger than this is not a kubelet's.
MAX_SCANNED = 20_000


def pinned_cpus(root: str = cgroupfs.DEFAULT_ROOT) -> CPUSet:
    """CPUs that running Guaranteed containers are pinned to, found in the cgroups below every
    ``kubepods`` cgroup: a container with a whole-CPU request whose cpuset holds exactly that
    many CPUs (fewer than the machine's) looks like an exclusive assignment from outside.
    Used after the state was lost, before the runtime has said what runs, so that no CPU is
    given twice; conservative - a shared pool that happens to be as large as such a
    container's request is kept out too, until the runtime's list replaces this guess.
    Empty when the cgroups cannot be read (nothing to go by)."""
    pinned = CPUSet()
    try:
        layout = cgroupfs.detect(root)
        with cgroupfs.CgroupFS(layout) as fs:
            everything = _root_cpus(fs)
            for top in _kubepods(fs):
                for path in fs.subtree("cpuset", top)[:MAX_SCANNED]:
                    if qos_from_cgroup_parent(path) != GUARANTEED:
                        continue
                    try:
                        if fs.children("cpuset", path) or not fs.populated(path):
                            continue
                        cpus = fs.cpus(path)
                        count = _whole_cpus(fs, path)
                    except cgroupfs.CgroupError:
                        continue  # gone meanwhile, or no cpu controller to tell its request
                    if count and len(cpus) == count and cpus != everything:
                        pinned |= cpus
    except cgroupfs.CgroupError:
        return CPUSet()
    return pinned


def _root_cpus(fs: cgroupfs.CgroupFS) -> CPUSet | None:
    try:
        return fs.cpus("/")
    except cgroupfs.CgroupError:
        return None


def _whole_cpus(fs: cgroupfs.CgroupFS, path: str) -> int | None:
    """The container's CPU request in whole CPUs, from kubelet's cpu.shares (v1) or
    cpu.weight (v2); None when it is not a whole number."""
    if fs.layout.version == cgroupfs.V2:
        weight = int(fs.read("cpu", path, "cpu.weight"))
        # kubelet: weight = 1 + (shares - 2) * 9999 // 262142, shares = 1024 per CPU.
        for count in range(1, 1025):
            if 1 + (count * SHARES_PER_CPU - 2) * 9999 // 262142 == weight:
                return count
        return None
    shares = int(fs.read("cpu", path, "cpu.shares"))
    return shares // SHARES_PER_CPU if shares % SHARES_PER_CPU == 0 else None


def _kubepods(fs: cgroupfs.CgroupFS) -> list[str]:
    """The kubepods cgroups (cgroupfs driver ``/kubepods``, systemd ``/kubepods.slice``),
    at the top or one level down (a node's own slice, a test's private parent)."""
    found = []
    for child in fs.children("cpuset", "/"):
        if child.rsplit("/", 1)[-1].startswith("kubepods"):
            found.append(child)
            continue
        for grandchild in fs.children("cpuset", child):
            if grandchild.rsplit("/", 1)[-1].startswith("kubepods"):
                found.append(grandchild)
    return found
