"""systemd's service notification protocol (sd_notify(3)): ``READY=1``, ``STATUS=...`` and
``WATCHDOG=1`` as one datagram each to the unix socket ``$NOTIFY_SOCKET`` names.

Written here rather than taken from a binding: the protocol is one ``sendto(2)`` of
``KEY=value`` lines, stable and documented, and a C extension would be one more thing to
build for every Python the package runs under.  Without ``$NOTIFY_SOCKET`` (not started by
systemd with Type=notify: a DaemonSet, a shell) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("nri_cpuplugin")


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (newline-separated ``KEY=value`` assignments); whether it was sent."""
    path = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):  # an abstract socket: a leading NUL byte on the wire
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Never wait: called from the event loop, which answers the runtime.  A receiver
            # whose queue is full (a few datagrams by default) loses this one instead.
            sock.sendto(message.encode(), socket.MSG_DONTWAIT, path)
    except OSError as err:
        log.debug("cannot notify systemd at %s: %s", path, err)
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds within which systemd expects ``WATCHDOG=1`` (WatchdogSec=), when it is meant for
    this process; None when there is no watchdog."""
    env = os.environ if environ is None else environ
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6
