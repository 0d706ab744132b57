"""Durable storage of the NodeState in a state directory.

Why it is built this way (see DESIGN.md, "State"):

* A commit writes a temp file in the same directory, fsyncs it, renames it over ``state.json``
  and fsyncs the directory.  rename(2) is atomic, so a crash at any instant leaves either the
  old or the new document on disk, never a mix; the fsyncs make that true across power loss too.
* Writers are serialised by ``filelock`` on ``state.lock``, a separate file that is never
  replaced or deleted: locking the data file itself would not work, because the rename swaps
  the inode out from under the lock.  filelock is re-entrant per object and says nothing about
  threads using different objects, so a process-wide registry adds a per-path mutex in front of
  it: any two StateStore objects on one directory exclude each other, across threads as well as
  across processes.
* ``load`` never raises.  A plugin that refuses to start because its cache is damaged would
  block every pod on the node; instead a bad or mismatched file is moved aside (kept for
  forensics), the problem is reported in one sentence, and the caller rebuilds from runtime
  truth.
* ``peek`` reads without the lock and never moves anything, so ``status`` can run next to a
  live daemon: commits are atomic renames, so a reader sees one whole document or the other.
"""

from __future__ import annotations

import _thread  # threading's Lock and get_ident, without importing threading (the hook)
import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator

from ..base.value import Value
from ..core.cpuset import CPUSet
from ..core.state import NodeState, StateFormatError, decode, encode

STATE_FILE = "state.json"
LOCK_FILE = "state.lock"
# Temp files are hidden and carry a distinct prefix so stale ones are easy to recognise and can
# never be confused with the live document or a quarantined one.
TEMP_PREFIX = ".state.json."
QUARANTINE_PREFIX = "state.json.bad-"
# Enough history to compare a few bad files, bounded so a crash loop cannot fill the disk.
QUARANTINE_KEEP = 10
# A real document is tens of KiB even on a large node; anything beyond this is not ours, and
# reading it would only waste memory (or never end, for a device).
MAX_STATE_BYTES = 64 * 1024 * 1024


# Wall clock for the names of set-aside files (a seam for tests).
_clock = time.time


class StateLockTimeout(Exception):
    """The state lock could not be taken in time; the message names the lock and what to do."""


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


class _Unusable(Exception):
    """The file exists but is not something we will parse (wrong type, too large, ...)."""


# --- in-process lock registry --------------------------------------------------------------


class _PathLock:
    """One per lock-file path per process: a mutex for threads, then the file lock for processes.

    Ownership is tracked here (not in filelock) so re-entry by the holding thread works through
    any StateStore object, and so ``commit`` can check that its caller really holds the lock.
    """

    def __init__(self, lock_path: str) -> None:
        self.lock_path = lock_path
        self.mutex = _thread.allocate_lock()
        # Imported on first use: filelock pulls in asyncio, ssl and sqlite3 (~90 ms), which the
        # OCI hook - started once per container, taking the same flock itself - must not pay.
        import filelock

        # thread_local=False: the holder may differ from the thread that created the object; the
        # mutex above guarantees only one thread touches it at a time.
        self.file_lock = filelock.FileLock(lock_path, mode=0o600, thread_local=False)
        self.owner: int | None = None  # thread ident of the holder

    def held_by_me(self) -> bool:
        return self.owner == _thread.get_ident()


_registry: dict[str, _PathLock] = {}
_registry_guard = _thread.allocate_lock()


def _reset_registry_after_fork() -> None:
    # A forked child inherits mutexes that may be held by threads that do not exist in it.
    global _registry, _registry_guard
    _registry = {}
    _registry_guard = _thread.allocate_lock()


os.register_at_fork(after_in_child=_reset_registry_after_fork)


def _path_lock(lock_path: str) -> _PathLock:
    # realpath so that two spellings of one directory (symlinks, "..") share one entry.
    key = os.path.realpath(lock_path)
    with _registry_guard:
        entry = _registry.get(key)
        if entry is None:
            entry = _registry[key] = _PathLock(key)
        return entry


# --- the store -------------------------------------------------------------------------------


class StateStore:
    """The state directory: ``state.json`` (the document) and ``state.lock`` (the writer lock)."""

    def __init__(self, state_dir: str | os.PathLike[str], lock_timeout: float = 10.0) -> None:
        # Nothing touches the disk here, so constructing a store (e.g. for ``status``) is free.
        # Plain strings, not pathlib: the OCI hook must not pay for importing it.
        self.state_dir = os.fspath(state_dir)
        self.lock_timeout = lock_timeout
        self.state_path = os.path.join(self.state_dir, STATE_FILE)
        self.lock_path = os.path.join(self.state_dir, LOCK_FILE)

    def __repr__(self) -> str:
        return f"StateStore({self.state_dir!r})"

    # --- locking ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, timeout: float | None = None) -> Iterator[StateStore]:
        """Hold the state lock for the block (re-entrant in the holding thread).

        ``timeout`` defaults to the store's ``lock_timeout``; a negative value waits forever.
        Raises StateLockTimeout when another process or thread keeps the lock longer.
        """
        wait = self.lock_timeout if timeout is None else timeout
        self._ensure_dir()
        entry = _path_lock(self.lock_path)
        if entry.held_by_me():  # re-entry: the outermost block releases
            yield self
            return
        deadline = None if wait < 0 else time.monotonic() + wait
        if not entry.mutex.acquire(timeout=-1 if wait < 0 else wait):
            raise StateLockTimeout(
                f"timed out after {wait:g}s waiting for the state lock {self.lock_path}: another "
                "thread of this process holds it; commits take milliseconds, so that thread is "
                "stuck (a bug worth reporting)"
            )
        try:
            remaining = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            import filelock  # already loaded by _PathLock; only binds the name here

            try:
                entry.file_lock.acquire(timeout=remaining)
            except filelock.Timeout:
                raise StateLockTimeout(
                    f"timed out after {wait:g}s waiting for the state lock {self.lock_path}: "
                    "another nri-cpuplugin process (daemon, hook or CLI) holds it; wait for it "
                    f"to finish or stop it (`fuser -v {self.lock_path}` shows who), then retry"
                ) from None
            entry.owner = _thread.get_ident()
            try:
                yield self
            finally:
                entry.owner = None
                entry.file_lock.release()
        finally:
            entry.mutex.release()

    def holds_lock(self) -> bool:
        """Whether the calling thread holds this directory's state lock."""
        with _registry_guard:
            entry = _registry.get(os.path.realpath(self.lock_path))
        return entry is not None and entry.held_by_me()

    def _ensure_dir(self) -> None:
        try:
            # 0o700: assignments name pods and containers; nobody but root needs to read them.
            os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        except FileExistsError:
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"state directory {self.state_dir} exists but is not a directory; remove it or "
                "configure another state directory",
                self.state_dir,
            ) from None

    # --- writing ---------------------------------------------------------------------------

    def commit(self, state: NodeState) -> CommitTiming:
        """Replace the stored state atomically and durably; the caller must hold the lock.

        The lock requirement is checked, not assumed: two unlocked writers could each be fine
        alone and still lose each other's update.
        """
        if not self.holds_lock():
            raise RuntimeError(
                f"StateStore.commit() called without holding the state lock {self.lock_path}; "
                "wrap the read-modify-commit sequence in `with store.locked():`"
            )
        started = time.perf_counter()
        self._remove_stale_temps()
        data = encode(state)
        tmp_name = os.path.join(self.state_dir, f"{TEMP_PREFIX}{os.urandom(6).hex()}")
        # O_EXCL: a name that somehow exists is never reused; 0o600 like the state itself.
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        renamed = False
        try:
            try:
                view = memoryview(data)
                while view:  # os.write may write less than asked (signals, quotas)
                    view = view[os.write(fd, view) :]
                sync_started = time.perf_counter()
                os.fsync(fd)
                fsync_seconds = time.perf_counter() - sync_started
            finally:
                os.close(fd)
            os.replace(tmp_name, self.state_path)
            renamed = True
            # The rename lives in the directory; without this fsync a power cut can revert it.
            dir_fd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                sync_started = time.perf_counter()
                os.fsync(dir_fd)
                fsync_seconds += time.perf_counter() - sync_started
            finally:
                os.close(dir_fd)
        except BaseException:
            if not renamed:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name)
            raise
        return CommitTiming(time.perf_counter() - started, fsync_seconds, len(data))

    def _remove_stale_temps(self) -> None:
        # Only a writer killed mid-commit leaves these, and we hold the lock, so none is live.
        with os.scandir(self.state_dir) as entries:
            for entry in entries:
                if entry.name.startswith(TEMP_PREFIX) and not entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

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
            state, problem, bad = self._inspect(expect)
            if not bad:
                return LoadResult(state, problem)
            try:
                with self.locked():
                    return self._load_locked(expect)
            except Exception as err:
                return LoadResult(
                    None,
                    f"{problem}; it was left in place because the lock could not be taken ({err})",
                )
        except Exception as err:  # never raise: the caller's fallback is to rebuild state
            return LoadResult(
                None, f"unexpected error loading {self.state_path}: {type(err).__name__}: {err}"
            )

    def peek(self, expect: Expected | None = None) -> LoadResult:
        """Read the stored state without locking and without moving anything; never raises.

        Safe next to a running daemon, because commits replace the file by atomic rename.
        """
        try:
            state, problem, _ = self._inspect(expect)
            return LoadResult(state, problem)
        except Exception as err:
            return LoadResult(
                None, f"unexpected error reading {self.state_path}: {type(err).__name__}: {err}"
            )

    def _load_locked(self, expect: Expected | None) -> LoadResult:
        state, problem, bad = self._inspect(expect)
        if not bad:
            return LoadResult(state, problem)
        try:
            moved = self._quarantine()
        except OSError as err:
            return LoadResult(None, f"{problem}; moving it aside failed too ({err})")
        return LoadResult(None, problem, moved)

    def _inspect(self, expect: Expected | None) -> tuple[NodeState | None, str | None, bool]:
        """(state, problem, move_aside): what the file holds and whether it must be set aside."""
        path = self.state_path
        try:
            data = self._read()
        except FileNotFoundError:
            return None, f"no state file at {path} (first start, or it was removed)", False
        except NotADirectoryError:
            return None, f"state directory {self.state_dir} is not a directory", False
        except _Unusable as err:
            return None, f"state file {path} {err}", True
        except OSError as err:
            return None, f"cannot read state file {path}: {err.strerror or err}", True
        if not data:
            return None, f"state file {path} is empty (0 bytes)", True
        try:
            state = decode(data)
        except StateFormatError as err:
            return None, f"state file {path} is not a valid state document: {err}", True
        except Exception as err:  # a decoder bug must not stop the plugin from starting
            return (
                None,
                f"state file {path} could not be decoded: {type(err).__name__}: {err}",
                True,
            )
        if expect is not None:
            mismatch = _mismatch(state, expect)
            if mismatch:
                return None, f"state file {path} does not match this node: {mismatch}", True
        return state, None, False

    def _read(self) -> bytes:
        """The file's bytes, refusing anything that is not a bounded regular file."""
        # O_NOFOLLOW: we only ever write regular files, so a symlink is foreign (and may point at
        # /dev/zero).  O_NONBLOCK: opening a FIFO must not wait for a writer that never comes.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.state_path, flags)
        except OSError as err:
            if err.errno == errno.ELOOP:
                target = "?"
                with contextlib.suppress(OSError):
                    target = os.readlink(self.state_path)
                raise _Unusable(f"is a symbolic link (to {target!r}), not a regular file") from None
            raise
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise _Unusable("is a directory, not a file")
            if not stat.S_ISREG(info.st_mode):
                raise _Unusable(f"is not a regular file (mode {stat.filemode(info.st_mode)})")
            if info.st_size > MAX_STATE_BYTES:
                raise _Unusable(_too_large(info.st_size))
            chunks: list[bytes] = []
            total = 0
            # Bounded even if the file grows while we read; st_size is only a hint.
            while total <= MAX_STATE_BYTES:
                chunk = os.read(fd, min(1 << 20, MAX_STATE_BYTES + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            if total > MAX_STATE_BYTES:
                raise _Unusable(_too_large(total))
            return b"".join(chunks)
        finally:
            os.close(fd)

    def set_aside(self) -> str | None:
        """Move a readable but unusable state file aside (kept); the caller holds the lock.

        For documents that decode fine but that the running policy cannot honour."""
        if not self.holds_lock():
            raise RuntimeError("StateStore.set_aside() needs the state lock")
        if not os.path.lexists(self.state_path):
            return None
        return self._quarantine()

    def _quarantine(self) -> str:
        """Rename the state file aside (never over an earlier one) and prune old ones."""
        seconds, micros = divmod(round(_clock() * 1_000_000), 1_000_000)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds)) + f".{micros:06d}Z"
        target = os.path.join(self.state_dir, f"{QUARANTINE_PREFIX}{stamp}")
        suffix = 0
        while os.path.lexists(target):  # same microsecond, or a clock that stepped back
            suffix += 1
            target = os.path.join(self.state_dir, f"{QUARANTINE_PREFIX}{stamp}-{suffix}")
        os.rename(self.state_path, target)
        self._prune_quarantine(keep=target)
        return target

    def _prune_quarantine(self, keep: str) -> None:
        # Names embed a UTC timestamp, so name order is age order.  Directories are left alone:
        # we never create them, and removing trees someone else made is not ours to do.
        with contextlib.suppress(OSError), os.scandir(self.state_dir) as entries:
            names = sorted(
                entry.name
                for entry in entries
                if entry.name.startswith(QUARANTINE_PREFIX)
                and not entry.is_dir(follow_symlinks=False)
            )
            for name in names[:-QUARANTINE_KEEP]:
                if name != os.path.basename(keep):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.state_dir, name))


def _too_large(size: int) -> str:
    return (
        f"is too large ({size} bytes, limit {MAX_STATE_BYTES // (1024 * 1024)} MiB); "
        "a real state document is a few KiB"
    )


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
