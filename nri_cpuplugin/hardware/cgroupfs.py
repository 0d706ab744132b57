"""cgroup v1 and v2 hierarchies, reached safely: the mount and its layout, a container's cgroups
from /proc/<pid>/cgroup, and ``CgroupFS``, confined reads and writes of their files.  The OCI
hook's cpuset / CFS-quota writes (cgroup_writes.py) and the daemon's (cpusets.py) go through
it; otherwise the NRI path never writes here: the runtime applies its adjustments.

Why it is built this way (docs/cgroups-and-hooks.md §10, §11):

* Confinement.  Every file is opened relative to a directory descriptor of the hierarchy's
  mount root, one path component at a time, with ``O_NOFOLLOW``: a path from outside (the
  runtime's state, /proc/<pid>/cgroup, a record file) cannot reach anything outside the mount,
  neither by ``..`` (rejected before any I/O) nor by a symbolic link (cgroupfs has none; a
  link in a look-alike tree makes the open fail).  Files are never created.
* Ordering and all or nothing: a container's cpuset and quota are written by
  cgroup_writes.py, on top of this.
"""

from __future__ import annotations

import errno
import os

from ..base.errors import PluginError, suppress
from ..base.value import Value
from ..core.cpuset import CPUSet

DEFAULT_ROOT = "/sys/fs/cgroup"
V1, V2 = 1, 2
# PATH_MAX and NAME_MAX: anything longer is not a cgroup path the kernel could have made.
MAX_PATH = 4096
MAX_COMPONENT = 255
# cgroup files we read are tiny (cpulists, "max 100000", pid lists are the largest); a
# populated check only needs the first byte.
MAX_READ = 1 << 20
# Nested cgroups below a container (crun's sub-cgroup, a container managing its own) are a
# few levels at most; the bound keeps a hostile tree from making us walk forever.
MAX_DEPTH = 16

_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class CgroupError(PluginError):
    """A cgroup could not be found, read or written; the message names the file and why.
    Codes: ``cgroup`` (generally), ``no-such-process`` (a pid that exited meanwhile).
    ``errno``: the system's error, where one said why (ENOENT: the cgroup is gone)."""

    code = "cgroup"
    errno: int | None = None


def _failed(message: str, err: OSError) -> CgroupError:
    error = CgroupError(message)
    error.errno = err.errno
    return error


def split_path(path: object) -> tuple[str, ...]:
    """Components of an absolute cgroup path (``/a/b`` -> ``("a", "b")``), validated.

    Raises CgroupError for anything the kernel would not print in /proc/<pid>/cgroup: not a
    string, relative, NUL bytes, ``.``/``..`` components, over-long paths or names.
    """
    if not isinstance(path, str):
        raise CgroupError(f"cgroup path must be a string, got {type(path).__name__}")
    shown = path if len(path) <= 200 else path[:200] + "..."
    if len(path) > MAX_PATH:
        raise CgroupError(f"cgroup path {shown!r} is longer than {MAX_PATH} characters")
    if "\0" in path:
        raise CgroupError(f"cgroup path {shown!r} contains a NUL byte")
    if not path.startswith("/"):
        raise CgroupError(f"cgroup path {shown!r} is not absolute")
    parts = tuple(part for part in path.split("/") if part)
    for part in parts:
        if part in (".", ".."):
            raise CgroupError(f"cgroup path {shown!r} contains a {part!r} component")
        if len(part) > MAX_COMPONENT:
            raise CgroupError(f"cgroup path {shown!r} has a component over {MAX_COMPONENT} bytes")
    return parts


def join(parts: tuple[str, ...]) -> str:
    return "/" + "/".join(parts)


class Layout(Value):
    """Where the hierarchies that matter to us are mounted."""

    version: int
    cpuset_root: str  # mount point of the cpuset hierarchy (v2: the unified one)
    cpu_root: str | None  # v1 hierarchy of the cpu controller (CFS quota); v2: as cpuset_root

    @property
    def controller_lines(self) -> tuple[str, str]:
        """Which /proc/<pid>/cgroup lines name the cpuset and cpu cgroups."""
        return ("", "") if self.version == V2 else ("cpuset", "cpu")


def detect(root: str = DEFAULT_ROOT) -> Layout:
    """cgroup v2 if ``root`` is a unified mount (it has ``cgroup.controllers``); otherwise v1
    with ``root/cpuset`` and ``root/cpu`` (often a link to ``cpu,cpuacct``; followed here once,
    because the root itself is configuration, not input)."""
    real = os.path.realpath(root)
    if os.path.isfile(os.path.join(real, "cgroup.controllers")):
        if not os.path.isfile(os.path.join(real, "cgroup.subtree_control")):
            raise CgroupError(f"{root} looks like cgroup v2 but has no cgroup.subtree_control")
        return Layout(V2, real, real)
    cpuset = os.path.realpath(os.path.join(real, "cpuset"))
    if not os.path.isfile(os.path.join(cpuset, "cpuset.cpus")):
        raise CgroupError(
            f"no cpuset controller under {root}: neither a cgroup v2 mount (cgroup.controllers) "
            f"nor a v1 cpuset hierarchy ({root}/cpuset/cpuset.cpus); pass --cgroup-root"
        )
    cpu = os.path.realpath(os.path.join(real, "cpu"))
    return Layout(
        V1, cpuset, cpu if os.path.isfile(os.path.join(cpu, "cpu.cfs_quota_us")) else None
    )


class ContainerCgroups(Value):
    """The cgroups of one container, as paths relative to their hierarchy's mount."""

    cpuset: str
    cpu: str | None


def parse_proc_cgroup(text: str, layout: Layout) -> ContainerCgroups:
    """The cpuset (and cpu) cgroup paths from /proc/<pid>/cgroup content.

    Lines are ``hierarchy-id:controller-list:path``; v2 has the single line ``0::path``, v1 one
    line per hierarchy (``7:cpuset:/...``, ``4:cpu,cpuacct:/...``)."""
    cpuset_key, cpu_key = layout.controller_lines
    found: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if layout.version == V2:
            if fields[0] == "0" and controllers == "":
                found[""] = path
            continue
        for name in controllers.split(","):
            found.setdefault(name, path)
    if cpuset_key not in found:
        wanted = "cgroup v2 line (0::)" if layout.version == V2 else "cpuset line"
        raise CgroupError(f"/proc/<pid>/cgroup has no {wanted}")
    cpuset = found[cpuset_key]
    split_path(cpuset)
    cpu = found.get(cpu_key) if layout.cpu_root is not None else None
    if cpu is not None:
        split_path(cpu)
    return ContainerCgroups(cpuset, cpu)


def read_proc_cgroup(pid: int, layout: Layout, proc: str = "/proc") -> ContainerCgroups:
    """The container's cgroups, found from its process (not from ``linux.cgroupsPath``: the
    systemd driver and crun's sub-cgroup make that notation differ from the real path)."""
    if type(pid) is not int or pid <= 0:
        raise CgroupError(f"invalid pid {pid!r}")
    path = f"{proc}/{pid}/cgroup"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_READ + 1)
    except FileNotFoundError:
        raise CgroupError(f"process {pid} does not exist (no {path})") from None
    except OSError as err:
        raise CgroupError(f"cannot read {path}: {err.strerror}") from None
    if len(data) > MAX_READ:
        raise CgroupError(f"{path} is larger than {MAX_READ} bytes")
    return parse_proc_cgroup(data.decode("utf-8", "surrogateescape"), layout)


class CgroupFS:
    """Confined reads and writes below the mounts of one Layout.

    Directory descriptors are cached for the object's lifetime (one hook run): a cgroup that is
    removed meanwhile makes later opens fail with ENOENT, which is what we want to see."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._dirs: dict[tuple[str, tuple[str, ...]], int] = {}

    def close(self) -> None:
        for fd in self._dirs.values():
            with suppress(OSError):
                os.close(fd)
        self._dirs.clear()

    def __enter__(self) -> CgroupFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def root(self, controller: str) -> str:
        if controller == "cpu":
            if self.layout.cpu_root is None:
                raise CgroupError("no cgroup hierarchy with the cpu controller is mounted")
            return self.layout.cpu_root
        return self.layout.cpuset_root

    def _dir(self, root: str, parts: tuple[str, ...]) -> int:
        key = (root, parts)
        fd = self._dirs.get(key)
        if fd is not None:
            return fd
        if parts:
            parent = self._dir(root, parts[:-1])
            try:
                fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
            except OSError as err:
                where = os.path.join(root, *parts)
                if err.errno == errno.ENOTDIR:
                    raise CgroupError(
                        f"{where} is not a directory (or is a symbolic link)"
                    ) from None
                if err.errno == errno.ELOOP:
                    raise CgroupError(
                        f"{where} is a symbolic link; refusing to follow it"
                    ) from None
                raise _failed(f"cgroup {where}: {err.strerror}", err) from None
        else:
            try:
                fd = os.open(root, _DIR_FLAGS)
            except OSError as err:
                raise _failed(f"cgroup mount {root}: {err.strerror}", err) from None
        self._dirs[key] = fd
        return fd

    def exists(self, controller: str, path: str) -> bool:
        try:
            self._dir(self.root(controller), split_path(path))
        except CgroupError:
            return False
        return True

    def read(self, controller: str, path: str, name: str) -> str:
        root = self.root(controller)
        parts = split_path(path)
        where = os.path.join(root, *parts, name)
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir(root, parts)
            )
        except OSError as err:
            raise _failed(f"cannot read {where}: {err.strerror}", err) from None
        try:
            data = os.read(fd, MAX_READ + 1)
        except OSError as err:
            raise _failed(f"cannot read {where}: {err.strerror}", err) from None
        finally:
            os.close(fd)
        if len(data) > MAX_READ:
            raise CgroupError(f"{where} is larger than {MAX_READ} bytes")
        return data.decode("ascii", "replace").strip()

    def open(self, controller: str, path: str, name: str, flags: int) -> int:
        """A descriptor of ``name`` in the cgroup (``.``: the cgroup's directory), reached
        without following links; the caller closes it."""
        root = self.root(controller)
        parts = split_path(path)
        try:
            return os.open(name, flags, dir_fd=self._dir(root, parts))
        except OSError as err:
            where = os.path.join(root, *parts, name)
            how = " for writing" if flags & (os.O_WRONLY | os.O_RDWR) else ""
            raise CgroupError(f"cannot open {where}{how}: {err.strerror}") from None

    def write(self, controller: str, path: str, name: str, value: str) -> None:
        where = os.path.join(self.root(controller), *split_path(path), name)
        # No O_CREAT: cgroup files exist or the controller is not there; we never create files.
        # O_TRUNC: what `echo > file` does; kernfs ignores it, a look-alike tree needs it.
        flags = os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = self.open(controller, path, name, flags)
        data = (value + "\n").encode()
        try:
            written = os.write(fd, data)
        except OSError as err:
            code = "no-such-process" if err.errno == errno.ESRCH else None
            raise CgroupError(f"writing {value!r} to {where} failed: {_why(err)}", code) from None
        finally:
            os.close(fd)
        if written != len(data):
            raise CgroupError(f"short write of {value!r} to {where} ({written} of {len(data)})")

    def children(self, controller: str, path: str) -> list[str]:
        """Child cgroup paths (directories only; the kernel has no links here)."""
        root = self.root(controller)
        parts = split_path(path)
        dir_fd = self._dir(root, parts)
        try:
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                with os.scandir(fd) as entries:
                    names = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
            finally:
                os.close(fd)
        except OSError as err:
            raise CgroupError(f"cannot list {os.path.join(root, *parts)}: {err.strerror}") from None
        return [join((*parts, name)) for name in names]

    def subdirectories(self, path: str) -> bool:
        """Whether cgroups are nested below ``path``: a directory's link count is 2 plus its
        subdirectories (kernfs keeps it so, as do ordinary filesystems), one fstat of the
        descriptor already open instead of listing the directory."""
        root = self.root("cpuset")
        parts = split_path(path)
        try:
            return os.fstat(self._dir(root, parts)).st_nlink > 2
        except OSError as err:
            raise CgroupError(f"cgroup {os.path.join(root, *parts)}: {err.strerror}") from None

    def subtree(self, controller: str, path: str) -> list[str]:
        """``path`` and its descendants, parents before children."""
        out = [path]
        frontier = [(path, 0)]
        while frontier:
            current, depth = frontier.pop()
            if depth >= MAX_DEPTH:
                raise CgroupError(f"cgroup {current} is nested deeper than {MAX_DEPTH} levels")
            for child in self.children(controller, current):
                out.append(child)
                frontier.append((child, depth + 1))
        return sorted(out, key=lambda p: len(split_path(p)))

    # --- queries used by the hook --------------------------------------------------------------

    def populated(self, path: str) -> bool:
        """Whether any process is in the cgroup or below it (a container whose processes are
        all gone is stale even if the runtime has not removed its cgroup yet)."""
        if self.layout.version == V2:
            for line in self.read("cpuset", path, "cgroup.events").splitlines():
                key, _, value = line.partition(" ")
                if key == "populated":
                    return value.strip() == "1"
        return any(self.read("cpuset", p, "cgroup.procs") for p in self.subtree("cpuset", path))

    def cpus(self, path: str) -> CPUSet:
        """The CPUs the cgroup's tasks may run on."""
        name = "cpuset.cpus.effective" if self.layout.version == V2 else "cpuset.cpus"
        return self.read_set(path, name)

    def requested(self, path: str) -> CPUSet:
        """What the cgroup's ``cpuset.cpus`` asks for (v2: empty means "inherit")."""
        return self.read_set(path, "cpuset.cpus")

    def parent_mems(self, path: str) -> CPUSet:
        """The memory nodes the parent of cgroup ``path`` may use (v2: its effective set, since
        an empty ``cpuset.mems`` there means "as its own parent")."""
        parent = join(split_path(path)[:-1])
        name = "cpuset.mems.effective" if self.layout.version == V2 else "cpuset.mems"
        return self.read_set(parent, name)

    def read_set(self, path: str, name: str) -> CPUSet:
        """A cpuset file of cgroup ``path`` (``cpuset.cpus``, ``cpuset.mems.effective``, ...)."""
        text = self.read("cpuset", path, name)
        try:
            return CPUSet.parse(text)
        except ValueError as err:
            raise CgroupError(f"cgroup {path}: {name} holds {text!r}: {err}") from None


# --- helpers ---------------------------------------------------------------------------------


_ERRNO_HINTS = {
    errno.EACCES: "not a subset of the parent's set (cgroup v1)",
    errno.EBUSY: "a child cgroup still uses CPUs being removed (cgroup v1)",
    errno.ENOSPC: "would leave a populated cgroup without CPUs or memory nodes",
    errno.EINVAL: "invalid value, an offline CPU, or overlap with a cpu_exclusive sibling",
    errno.ENODEV: "the cgroup was removed meanwhile",
}


def _why(err: OSError) -> str:
    hint = _ERRNO_HINTS.get(err.errno or 0)
    return f"{err.strerror}" + (f" ({hint})" if hint else "")
