"""One audit record per decision: who got which CPUs, when, and why.

Records are flat dictionaries of upper-case fields (journald's convention: MESSAGE, PRIORITY,
ACTION, CONTAINER_ID, CPUS, ...).  They go to the systemd journal when its socket exists, so
``journalctl -t nri-cpuplugin ACTION=allocate`` answers "who got which CPUs when"; otherwise to
stderr as one JSON line each.

Why the journal's native protocol written here rather than the systemd-python binding: the
protocol is small and stable (systemd.journal-fields(7), "Native Journal Protocol"), while the
binding is a C extension that needs libsystemd headers to build and does not exist for every
Python we run under (the OCI hook starts with whatever interpreter the node has).  No new
dependency, nothing to compile, and it works from a slim container image with only the socket
mounted.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
import time

from ..base import jsonbytes
from ..base.errors import suppress
from ..core.events import DEBUG, ERR, INFO, NOTICE, WARNING, AuditEvent

__all__ = ["DEBUG", "ERR", "INFO", "NOTICE", "WARNING", "Audit"]

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:
    import _socket
    from collections.abc import Callable, Iterable
    from typing import Any, TextIO

    Sink = Callable[[dict[str, str]], None]

IDENTIFIER = "nri-cpuplugin"
JOURNAL_SOCKET = "/run/systemd/journal/socket"

# journald accepts field names of upper-case letters, digits and '_', not starting with '_'
# (those are trusted fields journald sets itself).  Sets, not a regular expression: the hook
# would import re for this alone.
_FIELD_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_FIELD_CHARS = _FIELD_FIRST | {"_"}


def stderr_sink(stream: TextIO | None = None) -> Sink:
    def write(record: dict[str, str]) -> None:
        out = stream or sys.stderr
        out.write(jsonbytes.dumps(record).decode() + "\n")
        out.flush()

    return write


def encode_journal_entry(record: dict[str, str]) -> bytes:
    """The native protocol: ``KEY=value\\n``, or for values holding a newline
    ``KEY\\n<64-bit little-endian length><value>\\n``."""
    parts = []
    for key, value in record.items():
        if not key or key[0] not in _FIELD_FIRST or not _FIELD_CHARS.issuperset(key):
            raise ValueError(f"invalid journal field name {key!r}")
        data = value.encode()
        if b"\n" in data:
            parts.append(key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n")
        else:
            parts.append(key.encode() + b"=" + data + b"\n")
    return b"".join(parts)


class JournalSink:
    """Sends records as datagrams to journald; falls back to stderr if the journal goes away
    (a record is never silently lost)."""

    def __init__(self, path: str = JOURNAL_SOCKET, fallback: Sink | None = None) -> None:
        self.path = path
        self.fallback = fallback or stderr_sink()
        self._sock: _socket.socket | None = None

    def _connected(self) -> _socket.socket:
        # Connected once: a path lookup per record would cost as much as the send itself.
        # _socket is the socket module's own C core: importing ``socket`` itself (selectors,
        # enums) would add ~1.5 ms to every start of the OCI hook.
        import _socket

        if self._sock is None:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def __call__(self, record: dict[str, str]) -> None:
        payload = encode_journal_entry(record)
        for attempt in (1, 2):  # a journald restart leaves our connection dead: reconnect once
            try:
                self._connected().send(payload)
                return
            except OSError as err:
                if err.errno in (errno.EMSGSIZE, errno.ENOBUFS):
                    with suppress(OSError):
                        self._send_large(payload)
                        return
                    break
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                if attempt == 2:
                    break
        self.fallback(record)

    def _send_large(self, payload: bytes) -> None:
        # Too big for one datagram: journald accepts a sealed memfd passed with SCM_RIGHTS.
        fd = os.memfd_create("nri-cpuplugin-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, payload)
            import fcntl

            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
            )
            import _socket
            import array

            fds = array.array("i", [fd])
            self._connected().sendmsg([], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        finally:
            os.close(fd)


def default_sink() -> Sink:
    """The journal when this node has one, else stderr."""
    path = os.environ.get("NRI_CPUPLUGIN_JOURNAL_SOCKET", JOURNAL_SOCKET)
    if os.path.exists(path):
        return JournalSink(path)
    return stderr_sink()


class Audit:
    def __init__(self, sink: Sink | None = None, **common: str) -> None:
        self.sink = sink if sink is not None else default_sink()
        self.common = {"SYSLOG_IDENTIFIER": IDENTIFIER, **common}
        self.enabled = True

    def record(self, action: str, message: str, priority: int = INFO, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {
            **self.common,
            "MESSAGE": message,
            "PRIORITY": str(priority),
            "ACTION": action,
            "TIMESTAMP": f"{time.time():.6f}",
        }
        for key, value in fields.items():
            if value is not None and value != "":
                record[key.upper()] = str(value)
        self.sink(record)

    def emit(self, events: Iterable[AuditEvent], **extra: Any) -> None:
        """Record the engine's events in order; ``extra`` fields go on every one of them
        (what only the front end knows: how long it waited for the lock, cgroups written)."""
        for e in events:
            self.record(e.action, e.message, e.priority, **e.fields, **extra)
