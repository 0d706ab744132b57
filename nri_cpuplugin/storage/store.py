"""Durable storage of the NodeState in a state directory (daemon, OCI hook and CLI alike).

Why it is built this way:

* A commit replaces ``state.json`` atomically and durably (``base.files.write_atomic``), so a
  crash at any instant leaves the old or the new document on disk, never a mix.
* Writers are serialised by the state lock (``storage/lock.py``) on ``state.lock``, a separate
  file that is never replaced.
* Every name is opened relative to the state directory's handle, without following links; the
  directory itself must belong to us and be writable by nobody else, or nothing is used.
* ``load`` never raises: a plugin that refuses to start over a damaged cache would block every
  pod on the node.  A bad or mismatched file is moved aside (kept for forensics), reported in
  one sentence with a reason code, and the caller rebuilds from runtime truth.
* ``peek`` reads without the lock and moves nothing, so ``status`` can run next to a live
  daemon: commits are atomic renames, a reader sees one whole document or the other.
"""

from __future__ import annotations

import os
import stat
import time

from ..base import files
from ..base.errors import PluginError, suppress
from ..base.value import Value
from ..core.cpuset import CPUSet
from ..core.state import NodeState, StateFormatError, decode, encode
from . import lock
from .lock import LOCK_FILE, StateLockTimeout

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["LOCK_FILE", "StateDirError", "StateLockTimeout", "StateStore"]

STATE_FILE = "state.json"
QUARANTINE_PREFIX = "state.json.bad-"
# Enough history to compare a few bad files, bounded so a crash loop cannot fill the disk.
QUARANTINE_KEEP = 10
# A real document is tens of KiB on a large node; a bigger file (or a device) is not ours.
MAX_STATE_BYTES = 64 * 1024 * 1024

# LoadResult.code values: why there is no trusted state.
MISSING, UNUSABLE, CORRUPT, MISMATCH, ERROR = "missing", "unusable", "corrupt", "mismatch", "error"


class StateDirError(PluginError):
    """The state directory cannot be trusted or used; the message names it and what to do."""

    code = "state-dir"


class CommitTiming(Value):
    """How long one commit took, so benchmarks can report the share spent waiting on the disk."""

    total_seconds: float
    fsync_seconds: float  # file fsync + directory fsync
    bytes_written: int


class Expected(Value):
    """What the running configuration requires of a stored state before it may be trusted."""

    policy: str
    # None: any CPU layout is accepted, because the caller repairs a changed online set in place
    # (StaticPolicy.follow_online) instead of setting the file aside.
    fingerprint: str | None
    reserved: CPUSet


class LoadResult(Value):
    """Outcome of reading the state file: a trusted state, or why there is none."""

    state: NodeState | None
    problem: str | None = None
    quarantined: str | None = None
    code: str | None = None  # MISSING, UNUSABLE, CORRUPT, MISMATCH or ERROR when state is None


class Locked:
    """``StateStore.locked()``: a class rather than a ``contextlib.contextmanager`` generator,
    because importing contextlib (and the collections and functools it loads) is a measurable
    part of the OCI hook's start-up.  One use per object, like such a generator."""

    def __init__(self, store: StateStore, wait: float) -> None:
        self.store = store
        self.wait = wait
        self._fds: tuple[int, int] | None = None  # (lock file, state directory) while held
        self._entry: lock._Entry | None = None
        self._outer: tuple[lock._Entry | None, int | None] | None = None  # re-entered: restore

    def __enter__(self) -> StateStore:
        store = self.store
        dir_fd = store.open_dir()
        try:
            fd = lock.open_lock_file(dir_fd, store.lock_path)
            try:
                started = time.monotonic()
                entry, reentered = lock.acquire(fd, self.wait, store.lock_path, store.use_alarm)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            os.close(dir_fd)
            raise
        self._fds, self._entry = (fd, dir_fd), entry
        if reentered:
            self._outer = store._held, store._dir_fd
        else:
            store.lock_wait = time.monotonic() - started
        store._held, store._dir_fd = entry, dir_fd
        return store

    def __exit__(self, *exc: object) -> None:
        store = self.store
        assert self._fds is not None and self._entry is not None, "exit without enter"
        fd, dir_fd = self._fds
        try:
            try:
                if self._outer is not None:
                    store._held, store._dir_fd = self._outer
                else:
                    store._held = store._dir_fd = None
                    lock.release(self._entry)
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)


class StateStore:
    """The state directory: ``state.json`` (the document) and ``state.lock`` (the writer lock).

    ``use_alarm``: wait for a busy lock blocked in flock(2) under SIGALRM (single-threaded,
    short-lived callers: the OCI hook) rather than by polling.  ``clock``: the wall clock that
    names set-aside files (seconds since the epoch)."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        lock_timeout: float = 10.0,
        use_alarm: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Nothing touches the disk here, so constructing a store (e.g. for ``status``) is free.
        # Plain strings, not pathlib: the OCI hook must not pay for importing it.
        self.state_dir = os.fspath(state_dir)
        self.lock_timeout = lock_timeout
        self.use_alarm = use_alarm
        self.clock = clock
        self.state_path = os.path.join(self.state_dir, STATE_FILE)
        self.lock_path = os.path.join(self.state_dir, LOCK_FILE)
        self.lock_wait = 0.0  # how long the last outermost acquisition waited
        self._held: lock._Entry | None = None
        self._dir_fd: int | None = None

    def __repr__(self) -> str:
        return f"StateStore({self.state_dir!r})"

    # --- the directory ---------------------------------------------------------------------

    def open_dir(self, create: bool = True) -> int:
        """An O_DIRECTORY handle on the state directory, created (0700) if missing, after
        checking it is ours alone: owned by this user (root) and not writable by group or
        others - else anyone who can write there could plant links or replace our files."""
        try:
            fd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise files.FileError(
                    f"state directory {self.state_dir} does not exist", "missing", self.state_dir
                ) from None
            # Made only when missing: every lock opens the directory, and it exists but once.
            self._make_dir()
            return self.open_dir(create=False)
        except NotADirectoryError:
            what = "exists but is not" if os.path.lexists(self.state_dir) else "is not"
            raise StateDirError(
                f"state directory {self.state_dir} {what} a directory; remove it or configure "
                "another state directory"
            ) from None
        except OSError as err:
            raise StateDirError(
                f"cannot open state directory {self.state_dir}: {err.strerror or err}"
            ) from None
        info = os.fstat(fd)
        problem = None
        if info.st_uid != os.geteuid():
            problem = f"is owned by uid {info.st_uid}, not by uid {os.geteuid()} (us)"
        elif info.st_mode & 0o022:
            problem = f"is writable by group or others (mode {stat.filemode(info.st_mode)})"
        if problem is not None:
            os.close(fd)
            raise StateDirError(
                f"refusing to use state directory {self.state_dir}: it {problem}; anyone who "
                f"can write there could replace our files. Fix it with `chown root: "
                f"{self.state_dir} && chmod 0700 {self.state_dir}`, or configure another one"
            )
        return fd

    def _make_dir(self) -> None:
        try:
            os.mkdir(self.state_dir, mode=0o700)
        except FileNotFoundError:
            parent = os.path.dirname(os.path.abspath(self.state_dir))
            raise StateDirError(
                f"cannot create state directory {self.state_dir}: its parent {parent} does not "
                "exist (only the last component is created); create it, or fix the path"
            ) from None
        except FileExistsError:
            if not os.path.isdir(self.state_dir):  # (else made meanwhile by another process)
                raise StateDirError(
                    f"state directory {self.state_dir} exists but is not a directory; remove "
                    "it or configure another state directory"
                ) from None
        except OSError as err:
            raise StateDirError(
                f"cannot create state directory {self.state_dir}: {err.strerror or err}"
            ) from None

    # --- locking ---------------------------------------------------------------------------

    def locked(self, timeout: float | None = None) -> Locked:
        """Hold the state lock for the block (re-entrant in the holding thread):
        ``with store.locked(): ...`` (the block gets the store).

        ``timeout`` defaults to the store's ``lock_timeout``; a negative value waits forever.
        Raises StateLockTimeout when another process or thread keeps the lock longer.
        """
        return Locked(self, self.lock_timeout if timeout is None else timeout)

    def holds_lock(self) -> bool:
        """Whether the calling thread holds this directory's state lock through this store."""
        entry = self._held
        return entry is not None and entry.owner is not None and lock.held_by_me(entry.fd)

    def held_dir(self) -> int:
        """The state directory's handle while this thread holds the lock through this store:
        for other files of the directory, opened relative to it."""
        return self._locked_dir("held_dir")

    def _locked_dir(self, what: str) -> int:
        if not self.holds_lock() or self._dir_fd is None:
            raise RuntimeError(
                f"StateStore.{what}() called without holding the state lock {self.lock_path}; "
                "wrap the read-modify-commit sequence in `with store.locked():`"
            )
        return self._dir_fd

    # --- writing ---------------------------------------------------------------------------

    def commit(self, state: NodeState) -> CommitTiming:
        """Replace the stored state atomically and durably; the caller must hold the lock.

        The lock requirement is checked, not assumed: two unlocked writers could each be fine
        alone and still lose each other's update.
        """
        dir_fd = self._locked_dir("commit")
        started = time.perf_counter()
        # Temp files of a writer killed mid-commit; we hold the lock, so none is live.
        # (".state.json.<hex>" without ".tmp": the name earlier versions used)
        files.remove_temps(dir_fd, f".{STATE_FILE}.")
        data = encode(state)
        synced = files.write_atomic(self.state_dir, STATE_FILE, data, dir_fd=dir_fd)
        return CommitTiming(time.perf_counter() - started, synced, len(data))

    # --- reading ---------------------------------------------------------------------------

    def load(self, expect: Expected | None = None) -> LoadResult:
        """Read the stored state, moving aside anything unusable; never raises.

        Meant to be called with the lock held.  Without it, a file that needs moving aside is
        re-checked under the lock first, because another writer may have replaced it with a
        good one meanwhile; if the lock cannot be taken the file is left where it is.
        """
        try:
            if self.holds_lock():
                return self._load_locked(expect)
            result, bad = self._inspect(expect)
            if not bad:
                return result
            try:
                with self.locked():
                    return self._load_locked(expect)
            except Exception as err:
                return result.evolve(
                    problem=f"{result.problem}; it was left in place because the lock could "
                    f"not be taken ({err})"
                )
        except Exception as err:  # never raise: the caller's fallback is to rebuild state
            return LoadResult(
                None,
                f"unexpected error loading {self.state_path}: {type(err).__name__}: {err}",
                code=ERROR,
            )

    def peek(self, expect: Expected | None = None) -> LoadResult:
        """Read the stored state without locking and without moving anything; never raises.

        Safe next to a running daemon, because commits replace the file by atomic rename.
        """
        try:
            return self._inspect(expect)[0]
        except Exception as err:
            return LoadResult(
                None,
                f"unexpected error reading {self.state_path}: {type(err).__name__}: {err}",
                code=ERROR,
            )

    def _load_locked(self, expect: Expected | None) -> LoadResult:
        result, bad = self._inspect(expect)
        if not bad:
            return result
        try:
            moved = self._quarantine(self._locked_dir("load"))
        except OSError as err:
            return result.evolve(problem=f"{result.problem}; moving it aside failed too ({err})")
        return result.evolve(quarantined=moved)

    def _inspect(self, expect: Expected | None) -> tuple[LoadResult, bool]:
        """(what the file holds, whether it must be set aside)."""
        path = self.state_path
        try:
            data = self._read()
        except files.FileError as err:
            if err.code == "missing":
                problem = f"no state file at {path} (first start, or it was removed)"
                return LoadResult(None, problem, code=MISSING), False
            if err.code == "link":
                target = "?"
                with suppress(OSError):
                    target = os.readlink(path)
                problem = f"state file {path} is a symbolic link (to {target!r}), not a file"
            elif err.code == "too-large":
                problem = f"state file {err}; a real state document is a few KiB"
            elif err.code == "not-regular":
                problem = f"state file {path} {_kind(path)}"
            else:
                problem = f"cannot read state file {path}: {err}"
            return LoadResult(None, problem, code=UNUSABLE), True
        except StateDirError as err:
            return LoadResult(None, str(err), code=ERROR), False
        if not data:
            return LoadResult(None, f"state file {path} is empty (0 bytes)", code=CORRUPT), True
        try:
            state = decode(data)
        except StateFormatError as err:
            problem = f"state file {path} is not a valid state document: {err}"
            return LoadResult(None, problem, code=CORRUPT), True
        except Exception as err:  # a decoder bug must not stop the plugin from starting
            problem = f"state file {path} could not be decoded: {type(err).__name__}: {err}"
            return LoadResult(None, problem, code=CORRUPT), True
        if expect is not None:
            mismatch = _mismatch(state, expect)
            if mismatch:
                problem = f"state file {path} does not match this node: {mismatch}"
                return LoadResult(None, problem, code=MISMATCH), True
        return LoadResult(state), False

    def _read(self) -> bytes:
        if self._dir_fd is not None and self.holds_lock():
            return files.read_bounded(
                STATE_FILE, MAX_STATE_BYTES, dir_fd=self._dir_fd, what=self.state_path
            )
        try:
            dir_fd = self.open_dir(create=False)
        except files.FileError as err:
            raise files.FileError(str(err), "missing", self.state_path) from None
        try:
            return files.read_bounded(
                STATE_FILE, MAX_STATE_BYTES, dir_fd=dir_fd, what=self.state_path
            )
        finally:
            os.close(dir_fd)

    def set_aside(self) -> str | None:
        """Move a readable but unusable state file aside (kept); the caller holds the lock.

        For documents that decode fine but that the running policy cannot honour."""
        dir_fd = self._locked_dir("set_aside")
        try:
            os.stat(STATE_FILE, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return self._quarantine(dir_fd)

    def _quarantine(self, dir_fd: int) -> str:
        """Rename the state file aside (never over an earlier one) and prune old ones."""
        seconds, micros = divmod(round(self.clock() * 1_000_000), 1_000_000)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds)) + f".{micros:06d}Z"
        name = f"{QUARANTINE_PREFIX}{stamp}"
        suffix = 0
        while _exists(name, dir_fd):  # same microsecond, or a clock that stepped back
            suffix += 1
            name = f"{QUARANTINE_PREFIX}{stamp}-{suffix}"
        os.rename(STATE_FILE, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        self._prune_quarantine(dir_fd, keep=name)
        return os.path.join(self.state_dir, name)

    def _prune_quarantine(self, dir_fd: int, keep: str) -> None:
        # Names embed a UTC timestamp, so name order is age order.  Directories are left alone:
        # we never create them, and removing trees someone else made is not ours to do.
        with suppress(OSError), os.scandir(dir_fd) as entries:
            names = sorted(
                entry.name
                for entry in entries
                if entry.name.startswith(QUARANTINE_PREFIX)
                and not entry.is_dir(follow_symlinks=False)
            )
            for name in names[:-QUARANTINE_KEEP]:
                if name != keep:
                    with suppress(OSError):
                        os.unlink(name, dir_fd=dir_fd)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _kind(path: str) -> str:
    with suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return "is a directory, not a file"
    with suppress(OSError):
        return f"is not a regular file (mode {stat.filemode(os.lstat(path).st_mode)})"
    return "is not a regular file"


def _mismatch(state: NodeState, expect: Expected) -> str | None:
    """Why a well-formed state cannot be used with the current configuration, or None."""
    reasons = []
    if state.policy != expect.policy:
        reasons.append(f"policy changed from {state.policy!r} to {expect.policy!r}")
    if expect.fingerprint is not None and state.fingerprint != expect.fingerprint:
        reasons.append(
            f"CPU topology changed (fingerprint {state.fingerprint} -> {expect.fingerprint})"
        )
    if state.reserved != expect.reserved:
        reasons.append(
            f"reserved CPUs changed from {str(state.reserved) or '(none)'!r} "
            f"to {str(expect.reserved) or '(none)'!r}"
        )
    return "; ".join(reasons) or None
