"""Run a function in a child process with its own mount namespace and a small tmpfs: a full
disk without filling any real one.  The namespace, and the mount with it, end with the child,
whatever happens; nothing is left to clean up."""

from __future__ import annotations

import ctypes
import json
import os
import traceback
from collections.abc import Callable
from typing import Any

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 0x40000


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def in_private_tmpfs(path: str, size_kib: int, fn: Callable[[], Any], timeout: float = 60) -> Any:
    """``fn()`` in a child whose ``path`` is a fresh tmpfs of ``size_kib``; returns what it
    returned (JSON-able) or raises with the child's traceback."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        os.close(read_fd)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            # Private first, so the tmpfs below never propagates back to the host.
            _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
            os.makedirs(path, exist_ok=True)
            options = f"size={size_kib}k,mode=0700".encode()
            _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, options), f"mount {path}")
            reply = {"ok": fn()}
        except BaseException:
            reply = {"error": traceback.format_exc()}
        with os.fdopen(write_fd, "w") as out:
            out.write(json.dumps(reply, default=str))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    reply = json.loads(data) if data else {"error": "the child died without an answer"}
    if "error" in reply:
        raise RuntimeError(f"in the private mount namespace:\n{reply['error']}")
    return reply["ok"]


def fill(path: str) -> None:
    """Use up every free block of the file system holding ``path``."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):  # unbuffered: the last write fails, not a close
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
