"""CPU hotplug: kernel uevents into the daemon's event loop.

Listening (daemon only).  The kernel announces ``online``/``offline`` of ``SUBSYSTEM=cpu`` on
NETLINK_KOBJECT_UEVENT (docs/cgroups-and-hooks.md §13).  The socket is registered with the asyncio
loop (``add_reader``): the daemon sleeps in epoll until the kernel speaks - no polling, no
timer, no wake-up while nothing happens.  pyroute2 parses the messages (``MarshalUevent``); it
is imported when the listener starts.

The cgroup repairs hotplug needs (cgroup v1) are in cpusets.py.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable

from ..base.value import Value

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    import socket
    from typing import Any


KERNEL_GROUP = 1  # uevents as the kernel sends them (2 would be udevd's re-broadcast)
RCVBUF = 1 << 20  # a burst (SMT switched off offlines half the CPUs at once) must fit
SO_RCVBUFFORCE = 33  # Linux's value; Python 3.11's socket module does not export it
CPU_DEVPATH = "/devices/system/cpu/cpu"
ACTIONS = ("online", "offline")


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
