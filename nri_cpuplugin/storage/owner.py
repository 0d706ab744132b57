"""Which front end places a node's containers: the NRI daemon claims its state directory, and
the OCI hook leaves a claimed directory alone.

Both front ends can end up on one node by mistake (hooks.d files left behind when a CRI-O node
moved to NRI, or both packages installed).  Both would then place every container, each
treating the other's placements as stale, and a CPU could be given twice.  The daemon wins:

* it sees the container first (NRI CreateContainer is answered before the runtime runs
  ``runc create``, hence before the hook), so by the time the hook could act the container
  is already pinned and its siblings moved;
* it hears every lifecycle event and the runtime's list of containers after restarts, while
  the hook only sees creations and deletions.

The claim is ``flock(2)`` LOCK_EX on ``<state_dir>/daemon.lock`` for as long as the daemon
runs, with its pid in the file.  The kernel drops the lock when the process dies, SIGKILL
included, so the lock held means a daemon is alive right now; the file left behind means a
daemon has placed containers recorded in this directory.  The hook only probes it (a
non-blocking shared lock, released at once) and never waits.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from ..base.errors import PluginError
from ..base.value import Value

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable

DAEMON_FILE = "daemon.lock"
# The longest a pid written into the file can be; anything longer is not ours.
_MAX_CONTENT = 64


class ClaimError(PluginError):
    """Another daemon holds the state directory (or its claim file is unusable)."""

    code = "state-dir"


class DaemonClaim(Value):
    """What the claim file says: the daemon's pid (None if unreadable) and whether a live
    process holds the claim now."""

    pid: int | None
    running: bool


def _open(dir_fd: int, flags: int, path: str) -> int:
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(DAEMON_FILE, flags, 0o600, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ClaimError(f"{path} is not a regular file; remove it")
    return fd


def _pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, _MAX_CONTENT, 0).decode("ascii").strip()
        return int(text) if text.isdigit() else None
    except (OSError, UnicodeDecodeError):
        return None


def claim(
    dir_fd: int,
    state_dir: str,
    wait: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Take the daemon's claim on the state directory (``dir_fd``) and write our pid into it;
    returns the descriptor, which must stay open for as long as the claim should hold.

    Waits up to ``wait`` seconds (of ``clock``, between tries ``sleep``-ing): a daemon that is
    exiting (a runtime-launched one whose runtime restarts) releases it in a moment, and a
    hook's probe holds it for microseconds.  Raises ClaimError naming the other daemon's pid
    when it is still held."""
    path = os.path.join(state_dir, DAEMON_FILE)
    try:
        fd = _open(dir_fd, os.O_RDWR | os.O_CREAT, path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ClaimError(f"{path} is a symbolic link; nri-cpuplugin never makes one") from None
        raise ClaimError(f"cannot open {path}: {err.strerror or err}") from None
    deadline = clock() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if clock() >= deadline:
                other = _pid(fd)
                os.close(fd)
                raise ClaimError(
                    f"state directory {state_dir} is in use by another nri-cpuplugin daemon"
                    f"{f' (pid {other})' if other else ''}: one daemon per state directory "
                    "(is the plugin both runtime-launched and run as a service?)"
                ) from None
            sleep(0.02)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def probe(dir_fd: int, state_dir: str) -> DaemonClaim | None:
    """The daemon's claim on the state directory: None if no daemon ever claimed it; else
    its pid and whether it runs now.  Never waits and takes nothing for longer than the probe."""
    try:
        fd = _open(dir_fd, os.O_RDONLY, os.path.join(state_dir, DAEMON_FILE))
    except FileNotFoundError:
        return None
    except (OSError, ClaimError):
        # Unreadable or a link: someone made it, and it is not safe to assume no daemon.
        return DaemonClaim(None, True)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            running = False  # nobody holds it exclusively: no daemon alive
        except BlockingIOError:
            running = True
        return DaemonClaim(_pid(fd), running)
    finally:
        os.close(fd)  # releases the probe's shared lock, if it got one
