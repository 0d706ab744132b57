"""Is a container still running?  Asked of its cgroup when the runtime cannot tell us.

containerd 1.7 does not resend the state to a plugin it launched (no Synchronize), and after a
containerd restart it does not report the stop of containers created before the restart
(docs/nri-wire.md §5.2, §9.3).  A plugin that only listened would keep their CPUs forever, so
while unsynchronized the plugin checks its assignments against the cgroups: a container whose
cgroup is gone, or holds no process, has ended.
"""

from __future__ import annotations

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
    parts = []
    if slice_name and slice_name != "-.slice":
        stem = slice_name.removesuffix(SYSTEMD_SUFFIX)
        pieces = stem.split("-")
        parts = ["-".join(pieces[: i + 1]) + SYSTEMD_SUFFIX for i in range(len(pieces))]
    unit = f"{prefix}-{name}.scope" if prefix else f"{name}.scope"
    return "/" + "/".join([*parts, unit])


class Liveness:
    """Checks containers' cgroups below one cgroup mount (v1 cpuset hierarchy or v2)."""

    def __init__(self, root: str = cgroupfs.DEFAULT_ROOT) -> None:
        self.root = root

    def alive(self, runtime_path: str) -> bool | None:
        """True/False when the cgroup says so; None when it cannot be told (no path, odd
        path, unreadable mount): the caller must then keep what it has."""
        if not runtime_path:
            return None
        try:
            layout = cgroupfs.detect(self.root)
            with cgroupfs.CgroupFS(layout) as fs:
                path = cgroup_path(runtime_path)
                cgroupfs.split_path(path)  # a malformed path says nothing about liveness
                if not fs.exists("cpuset", path):
                    return False
                return fs.populated(path)
        except cgroupfs.CgroupError:
            return None
