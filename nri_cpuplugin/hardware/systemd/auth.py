"""D-Bus authentication from the client's side, sans I/O: the SASL EXTERNAL exchange that opens
a connection before its first message (D-Bus specification, "Authentication Protocol").

EXTERNAL is the mechanism of a local socket: the bus (or systemd's private socket) knows our
uid from the socket's credentials, and we only name it.
"""

from __future__ import annotations

from .wire import DBusWireError

MAX_AUTH_LINE = 512


def auth_external(uid: int) -> bytes:
    """The client's whole SASL exchange at once: the credentials byte, ``AUTH EXTERNAL`` with
    the uid as hex-encoded decimal digits, and ``BEGIN``.  Sending BEGIN before the server's OK
    saves a round trip; sd-bus does the same, and the first byte after BEGIN's CRLF may then be
    the first message."""
    return b"\0AUTH EXTERNAL " + str(uid).encode().hex().encode() + b"\r\nBEGIN\r\n"


def auth_reply(buffer: bytes | bytearray) -> tuple[str, int] | None:
    """(server GUID, bytes used) once the server's first line is complete, None before.  Any
    answer but OK raises: with BEGIN already sent there is nothing left to negotiate."""
    end = buffer.find(b"\r\n")
    line_bytes = buffer if end < 0 else buffer[:end]
    if not bytes(line_bytes[:MAX_AUTH_LINE]).isascii() or any(b < 0x20 for b in line_bytes):
        raise DBusWireError(f"unexpected authentication answer {bytes(line_bytes[:40])!r}")
    if end < 0:
        if len(buffer) > MAX_AUTH_LINE:
            raise DBusWireError(f"authentication line longer than {MAX_AUTH_LINE} bytes")
        return None
    line = bytes(buffer[:end]).decode("ascii", "replace")
    command, _, argument = line.partition(" ")
    if command == "OK" and argument and all(c in "0123456789abcdef" for c in argument):
        return argument, end + 2
    if command == "REJECTED":
        raise DBusWireError(
            f"the bus refused EXTERNAL authentication (it offers: {argument or 'nothing'})"
        )
    raise DBusWireError(f"unexpected authentication answer {line[:80]!r}")
