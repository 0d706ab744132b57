"""CPU hotplug: kernel uevents into the daemon's event loop, and the cgroup repairs hotplug needs.

Listening (daemon only).  The kernel announces ``online``/``offline`` of ``SUBSYSTEM=cpu`` on
NETLINK_KOBJECT_UEVENT (docs/cgroups-and-hooks.md §13).  The socket is registered with the asyncio
loop (``add_reader``): the daemon sleeps in epoll until the kernel speaks - no polling, no
timer, no wake-up while nothing happens.  pyroute2 parses the messages (``MarshalUevent``); it
is imported when the listener starts, so the OCI hook, which imports this module for the
repairs below, never loads it.

Repairs (daemon and hook).  cgroup v1 removes an offlined CPU from every cpuset and never adds
it back; a cpuset left without CPUs has its tasks moved by the kernel to the nearest ancestor
that still has some (asynchronously, from a workqueue).  So after a change:

* ancestors of our containers' cgroups must be grown top-down before a container can get a
  returning CPU (``cgroupfs.set_cpuset`` does that for every write);
* tasks the kernel evicted must be put back into their container's cpuset once it has CPUs
  again: they are found in the ancestors' ``cgroup.procs`` by their other controllers' cgroup
  (cpu, memory), which the kernel left where runc put them.

cgroup v2 needs neither: ``cpuset.cpus`` keeps the configuration and ``.effective`` follows the
online CPUs by itself.  Background: docs/cgroups-and-hooks.md §12 (cgroups), §13 (uevents).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterable

from ..base.value import Value
from ..core.cpuset import CPUSet
from ..core.events import WARNING, AuditEvent, event
from . import cgroupfs
from .liveness import cgroup_path

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    import socket
    from typing import Any


KERNEL_GROUP = 1  # uevents as the kernel sends them (2 would be udevd's re-broadcast)
RCVBUF = 1 << 20  # a burst (SMT switched off offlines half the CPUs at once) must fit
SO_RCVBUFFORCE = 33  # Linux's value; Python 3.11's socket module does not export it
CPU_DEVPATH = "/devices/system/cpu/cpu"
ACTIONS = ("online", "offline")
# Controllers whose cgroup the kernel does not move when it evicts tasks from a cpuset.
_WITNESSES = ("cpu", "cpu,cpuacct", "cpuacct,cpu", "memory", "pids")


class CPUEvent(Value):
    action: str  # "online" | "offline"; "overflow" when events were lost (re-read sysfs)
    cpu: int  # -1 for "overflow"
    received: float  # time.monotonic() when the daemon read it


def cpu_event(message: Any, received: float) -> CPUEvent | None:
    """The CPU event in a parsed uevent (a mapping of its KEY=value fields), or None."""
    if message.get("SUBSYSTEM") != "cpu" or message.get("ACTION") not in ACTIONS:
        return None
    devpath = message.get("DEVPATH") or ""
    if not devpath.startswith(CPU_DEVPATH) or not devpath[len(CPU_DEVPATH) :].isdigit():
        return None
    return CPUEvent(message["ACTION"], int(devpath[len(CPU_DEVPATH) :]), received)


class UeventListener:
    """Calls ``callback(events)`` with the CPU events of each batch the kernel delivered."""

    def __init__(self, callback: Callable[[list[CPUEvent]], None]) -> None:
        self.callback = callback
        self._sock: socket.socket | None = None
        self._loop: Any = None
        self._marshal: Any = None

    def start(self, loop: Any) -> None:
        import socket

        from pyroute2.netlink import NETLINK_KOBJECT_UEVENT
        from pyroute2.netlink.uevent import MarshalUevent

        sock = socket.socket(
            socket.AF_NETLINK,
            socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
            NETLINK_KOBJECT_UEVENT,
        )
        try:
            with contextlib.suppress(OSError):  # needs CAP_NET_ADMIN; the plain size is fine
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            sock.bind((0, KERNEL_GROUP))
            loop.add_reader(sock.fileno(), self._readable)
        except BaseException:
            sock.close()
            raise
        self._sock, self._loop, self._marshal = sock, loop, MarshalUevent()

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _readable(self) -> None:
        assert self._sock is not None
        events: list[CPUEvent] = []
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno == errno.ENOBUFS:  # the kernel dropped some: re-read everything
                    events.append(CPUEvent("overflow", -1, time.monotonic()))
                    continue
                raise
            received = time.monotonic()
            for message in self._marshal.parse(data):
                event = cpu_event(message, received)
                if event is not None:
                    events.append(event)
        if events:
            self.callback(events)


# --- audit (daemon and hook) ---------------------------------------------------------------------


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


# --- cgroup repairs ------------------------------------------------------------------------------


class Target(Value):
    """A container cgroup to bring to a cpuset."""

    container_id: str
    runtime_path: str  # the runtime's cgroupsPath (cgroupfs or systemd notation)
    cpus: CPUSet
    mems: CPUSet | None = None


class Applied(Value):
    errors: list[str]  # one line per container that could not be written
    returned: dict[str, int]  # container id -> processes put back into its cpuset (v1)


def apply(layout: cgroupfs.Layout, targets: Iterable[Target], proc: str = "/proc") -> Applied:
    """Write each target's cpuset (ancestors grown top-down first), CPUs taken away before
    CPUs are given; then, on cgroup v1, put back tasks the kernel evicted.  One container's
    failure (it may be exiting) does not stop the others."""
    errors: list[str] = []
    returned: dict[str, int] = {}
    with cgroupfs.CgroupFS(layout) as fs:
        resolved = []
        for target in targets:
            path = cgroup_path(target.runtime_path)
            try:
                current = fs.cpus(path)
            except cgroupfs.CgroupError as err:
                errors.append(f"{target.container_id[:12]}: {err}")
                continue
            resolved.append((bool(current - target.cpus), path, target))
        resolved.sort(key=lambda item: (not item[0], item[2].container_id))
        for _, path, target in resolved:
            tx = cgroupfs.Transaction(fs)
            try:
                with tx:
                    cgroupfs.set_cpuset(tx, path, target.cpus, target.mems)
                if layout.version == cgroupfs.V1:
                    moved = return_evicted_tasks(fs, path, proc)
                    if moved:
                        returned[target.container_id] = moved
            except cgroupfs.CgroupError as err:
                error = f"{target.container_id[:12]}: {err}"
                if tx.rollback_errors:
                    error += f" (undoing earlier writes failed: {'; '.join(tx.rollback_errors)})"
                errors.append(error)
    return Applied(errors, returned)


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
