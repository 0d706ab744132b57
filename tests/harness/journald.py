"""A real systemd-journald in a private mount namespace, for audit-trail tests.

journald runs inside ``unshare -m`` with tmpfs over /run/systemd, /run/log and
/var/log/journal, so nothing reaches the host's journal and everything vanishes with the
namespace.  Processes under test reach its socket through ``/proc/<pid>/root/...`` (pass
``socket_path`` as NRI_CPUPLUGIN_JOURNAL_SOCKET), and ``journalctl`` runs inside the
namespace with ``nsenter``.  Works without systemd as PID 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

JOURNALD = "/lib/systemd/systemd-journald"
_SOCKETS = "/run/systemd/journal"
_SETUP = (
    "set -e; for d in /run/systemd /run/log /var/log/journal; do "
    "mkdir -p $d; mount -t tmpfs tmpfs $d; done; exec " + JOURNALD
)


class JournalError(RuntimeError):
    pass


class PrivateJournal:
    """``socket_dir``: a directory of this machine that journald's socket directory
    (``/run/systemd/journal``) is bound to, so its sockets can be mounted into a container
    (a path through ``/proc/<pid>/root`` cannot be)."""

    def __init__(self, socket_dir: str | None = None) -> None:
        self.proc: subprocess.Popen | None = None
        self.socket_dir = socket_dir

    def __enter__(self) -> PrivateJournal:
        if not os.path.exists(JOURNALD):
            raise JournalError(f"{JOURNALD} not found: install Debian's systemd package")
        setup = _SETUP
        if self.socket_dir is not None:
            os.makedirs(self.socket_dir, exist_ok=True)
            setup = setup.replace(
                "exec ", f'mkdir -p {_SOCKETS}; mount --bind "$1" {_SOCKETS}; exec ', 1
            )
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "/bin/sh", "-c", setup, "sh",
             self.socket_dir or ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not os.path.exists(self.socket_path):
            if self.proc.poll() is not None:
                raise JournalError(
                    f"journald exited ({self.proc.returncode}): {self.proc.stderr.read()!r}"
                )
            if time.monotonic() > deadline:
                self.__exit__()
                raise JournalError("journald did not create its socket within 10 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # The namespace (and its tmpfs mounts) dies with its last process.

    @property
    def socket_path(self) -> str:
        if self.socket_dir is not None:
            return os.path.join(self.socket_dir, "socket")
        assert self.proc is not None
        return f"/proc/{self.proc.pid}/root{_SOCKETS}/socket"

    def _journalctl(self, *args: str) -> str:
        assert self.proc is not None
        result = subprocess.run(
            ["nsenter", "-t", str(self.proc.pid), "-m", "journalctl", "--no-pager", *args],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if result.returncode not in (0, 1):  # 1: no entries matched
            raise JournalError(f"journalctl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def entries(self, *matches: str, identifier: str = "nri-cpuplugin") -> list[dict]:
        """``journalctl -t IDENTIFIER MATCH... -o json`` after flushing what was received."""
        self._journalctl("--sync")
        # --all: without it journalctl prints fields over 4 KiB as null
        out = self._journalctl("-t", identifier, "-o", "json", "--all", *matches)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def wait_entries(self, *matches: str, count: int = 1, timeout: float = 10.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            found = self.entries(*matches)
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)
