"""Reading and replacing small files safely: the one copy of both, for every front end.

Both run as root next to directories that other software (or an attacker with a foothold) may
have touched, so:

* nothing follows a symbolic link in the last path component (``O_NOFOLLOW``), and a name
  that is not a regular file is refused before a byte is read - a FIFO would block forever,
  a device would never end;
* reads are bounded: a file larger than the caller's limit is an error, not a memory spike;
* a replacement is written to a fresh temp name (``O_EXCL``) in the same directory, flushed,
  renamed over the target and - when ``durable`` - fsynced with its directory, so a crash
  at any instant leaves the old or the new file, never a mix; the temp file never outlives
  a failure.

``dir_fd`` arguments make every name relative to an open directory, so a directory swapped
for a link between two calls cannot redirect the second one.  Only ``os`` is used: the OCI
hook pays for every import.
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import PluginError, suppress

CHUNK = 1 << 20


class FileError(PluginError, OSError):
    """A file that cannot be used as asked; ``code`` says why, the message names the file.
    An OSError too, so handlers of I/O failures need not know it.

    Codes: ``missing``, ``link`` (a symbolic link), ``not-regular``, ``too-large``, ``io``."""

    code = "io"

    def __init__(self, message: str, code: str = "io", path: str = "") -> None:
        super().__init__(message, code)
        self.path = path


def read_bounded(path: str, limit: int, *, dir_fd: int | None = None, what: str = "") -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``), never following a link."""
    label = what or path
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileError(f"{label} does not exist", "missing", path) from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise FileError(
                f"{label} is a symbolic link, not a regular file; remove it", "link", path
            ) from None
        raise FileError(f"cannot read {label}: {err.strerror or err}", "io", path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileError(
                f"{label} is not a regular file (mode {stat.filemode(info.st_mode)}); remove it",
                "not-regular",
                path,
            )
        if info.st_size > limit:
            raise FileError(_too_large(label, info.st_size, limit), "too-large", path)
        chunks: list[bytes] = []
        total = 0
        # st_size is only a hint: the file may grow while it is read.
        while total <= limit:
            try:
                chunk = os.read(fd, min(CHUNK, limit + 1 - total))
            except OSError as err:
                raise FileError(f"cannot read {label}: {err.strerror}", "io", path) from None
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise FileError(_too_large(label, total, limit), "too-large", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_atomic(
    directory: str,
    name: str,
    data: bytes,
    *,
    mode: int = 0o600,
    durable: bool = True,
    dir_fd: int | None = None,
) -> float:
    """Replace ``directory/name`` with ``data`` in one rename; returns the seconds spent in
    fsync.  ``dir_fd`` (an open handle on ``directory``) is used for every name when given."""
    if dir_fd is not None:
        return _replace(dir_fd, directory, name, data, mode, durable)
    own_dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _replace(own_dir_fd, directory, name, data, mode, durable)
    finally:
        os.close(own_dir_fd)


def _replace(
    dir_fd: int, directory: str, name: str, data: bytes, mode: int, durable: bool
) -> float:
    """write_atomic's steps: a new temp file written (and synced), renamed over ``name``, the
    directory synced; the temp file removed again if it was not renamed."""
    tmp = f".{name}.{os.urandom(6).hex()}.tmp"
    label = os.path.join(directory, name)
    try:
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            mode,
            dir_fd=dir_fd,
        )
    except OSError as err:
        raise _write_error(label, err) from None
    synced = 0.0
    renamed = False
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask said
            view = memoryview(data)
            while view:  # os.write may write less than asked (signals, quotas)
                view = view[os.write(fd, view) :]
            if durable:
                synced = _fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        renamed = True
        if durable:
            # The rename lives in the directory: without this a power cut can revert it.
            synced += _fsync(dir_fd)
    except OSError as err:
        if not renamed:
            _unlink_quietly(tmp, dir_fd)
        raise _write_error(label, err) from None
    except BaseException:
        if not renamed:
            _unlink_quietly(tmp, dir_fd)
        raise
    return synced


def remove_temps(dir_fd: int, prefix: str, suffix: str = "", min_age: float = 0.0) -> None:
    """Remove the temp files of ``write_atomic`` calls that never finished (a writer killed
    between creating the temp file and renaming it): regular files in ``dir_fd`` whose name
    starts with ``prefix`` (``.<name>.``) and ends with ``suffix``.  Call it where no such
    write can be in progress (the caller holds the lock the writers take), or give
    ``min_age``: only files untouched for that many seconds go, so a writer that takes no
    lock is not raced."""
    import time

    now = time.time()
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not (entry.name.startswith(prefix) and entry.name.endswith(suffix)):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode) and now - info.st_mtime >= min_age:
                _unlink_quietly(entry.name, dir_fd)


def _fsync(fd: int) -> float:
    import time  # (already loaded by the interpreter; binding it here keeps module load lean)

    started = time.perf_counter()
    os.fsync(fd)
    return time.perf_counter() - started


def _unlink_quietly(name: str, dir_fd: int | None) -> None:
    with suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def _write_error(label: str, err: OSError) -> FileError:
    code = "no-space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
    return FileError(f"cannot write {label}: {err.strerror or err}", code, label)


def _too_large(label: str, size: int, limit: int) -> str:
    return f"{label} is too large ({size} bytes, limit {limit}); it is not one of ours"
