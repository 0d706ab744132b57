"""The state lock: one implementation for the daemon, the OCI hook and the CLI.

``flock(2)`` LOCK_EX on ``<state_dir>/state.lock``, a file that is never replaced (locking the
state document itself would not work: each commit renames a new inode over it).  Processes
exclude each other through the kernel; threads of one process through a mutex kept per lock
*inode* - the identity of what is locked, whatever path spelt it - so no path is ever resolved
and a link planted in place of the lock file is refused, never followed.

The lock file is opened relative to the state directory's handle, without following links, and
must be a regular file.  Waiting is bounded unless the caller asks to wait for ever (the
daemon, whose request budget answers the runtime meanwhile): the hook, a short-lived
single-threaded process, blocks in flock(2) under a one-shot SIGALRM (the next waiter runs the
moment the lock is free); everything else polls with a short back-off, since a signal would
disturb an event loop.
"""

from __future__ import annotations

import _thread  # threading's lock and get_ident without importing threading (the hook)
import errno
import fcntl
import os
import stat
import time

from ..base.errors import PluginError

LOCK_FILE = "state.lock"


class StateLockTimeout(PluginError):
    """The state lock could not be taken in time; the message names the lock and what to do."""

    code = "lock-timeout"


class _Entry:
    """One per lock inode per process: a mutex for threads and who holds it."""

    def __init__(self) -> None:
        self.mutex = _thread.allocate_lock()
        self.owner: int | None = None
        self.fd: int | None = None  # the flock'ed descriptor while held


_entries: dict[tuple[int, int], _Entry] = {}
_guard = _thread.allocate_lock()


def _reset_after_fork() -> None:
    # A forked child inherits mutexes that may be held by threads that do not exist in it.
    global _entries, _guard
    _entries = {}
    _guard = _thread.allocate_lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def open_lock_file(dir_fd: int, path_for_messages: str) -> int:
    """Open (creating) the lock file below ``dir_fd``; refuse links and non-regular files."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(LOCK_FILE, flags, 0o600, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise StateLockTimeout(
                f"the state lock {path_for_messages} is a symbolic link; nri-cpuplugin never "
                "creates one: remove it (and check who made it)",
                "lock-unusable",
            ) from None
        raise StateLockTimeout(
            f"cannot open the state lock {path_for_messages}: {err.strerror or err}",
            "lock-unusable",
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise StateLockTimeout(
            f"the state lock {path_for_messages} is not a regular file "
            f"({stat.filemode(info.st_mode)}); remove it",
            "lock-unusable",
        )
    return fd


def _entry_for(fd: int) -> _Entry:
    info = os.fstat(fd)
    key = (info.st_dev, info.st_ino)
    with _guard:
        entry = _entries.get(key)
        if entry is None:
            entry = _entries[key] = _Entry()
        return entry


def acquire(fd: int, wait: float, path: str, use_alarm: bool) -> tuple[_Entry, bool]:
    """Take the lock on the open lock file ``fd``: (entry, re-entered).  ``wait`` < 0 waits
    forever.  On re-entry by the holding thread the caller's ``fd`` is not used."""
    entry = _entry_for(fd)
    me = _thread.get_ident()
    if entry.owner == me:
        return entry, True
    started = time.monotonic()
    if not entry.mutex.acquire(timeout=-1 if wait < 0 else wait):
        raise StateLockTimeout(
            f"timed out after {wait:g}s waiting for the state lock {path}: another thread of "
            "this process holds it; commits take milliseconds, so that thread is stuck (a bug "
            "worth reporting)"
        )
    try:
        remaining = -1.0 if wait < 0 else max(0.0, wait - (time.monotonic() - started))
        if not _try_flock(fd):
            if use_alarm and remaining > 0:
                _wait_with_alarm(fd, remaining, path)
            else:
                _wait_polling(fd, remaining, path)
    except BaseException:
        entry.mutex.release()
        raise
    entry.owner, entry.fd = me, fd
    return entry, False


def release(entry: _Entry) -> None:
    fd = entry.fd
    entry.owner = entry.fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        entry.mutex.release()


def held_by_me(fd_or_none: int | None) -> bool:
    if fd_or_none is None:
        return False
    try:
        entry = _entry_for(fd_or_none)
    except OSError:
        return False
    return entry.owner == _thread.get_ident()


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _timeout(wait: float, path: str) -> StateLockTimeout:
    return StateLockTimeout(
        f"timed out after {wait:.3g}s waiting for the state lock {path}: another nri-cpuplugin "
        "process (daemon, hook or CLI) holds it; wait for it to finish or stop it (`fuser -v "
        f"{path}` shows who), then retry"
    )


class _Expired(Exception):
    pass


def _wait_with_alarm(fd: int, wait: float, path: str) -> None:
    # Imported only when the lock is busy: most hook runs never wait.
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        _wait_polling(fd, wait, path)  # signals only reach the main thread
        return
    waiting = [True]

    def expire(signum: int, frame: object) -> None:
        if waiting[0]:
            raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, wait)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    except _Expired:
        # The alarm may have hit just after flock returned: then we hold the lock.
        if _try_flock(fd):
            return
    finally:
        waiting[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    raise _timeout(wait, path)


def _wait_polling(fd: int, wait: float, path: str) -> None:
    deadline = None if wait < 0 else time.monotonic() + wait
    delay = 0.001
    while deadline is None or time.monotonic() < deadline:
        time.sleep(delay)
        if _try_flock(fd):
            return
        delay = min(delay * 2, 0.02)
    raise _timeout(wait, path)
