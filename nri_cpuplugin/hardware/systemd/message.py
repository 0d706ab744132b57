"""D-Bus messages: a whole message built into bytes (a method call, a return, an error), the
decoded ``Message`` that unmarshal.py gives back, and a connection's serials.

A message is a 12-byte fixed header, the header fields as ``a(yv)`` padded to 8 bytes, and the
body marshalled by its SIGNATURE field (wire.py: the values and their types; D-Bus
specification, "Message Format").  The header fields a caller repeats (path, interface, member,
destination) are marshalled once and kept.
"""

from __future__ import annotations

from .wire import (
    DESTINATION,
    ERROR,
    ERROR_NAME,
    FIELD_TYPES,
    HEADERS,
    INTERFACE,
    MAX_MESSAGE,
    MEMBER,
    METHOD_CALL,
    METHOD_RETURN,
    NO_REPLY_EXPECTED,
    PATH,
    REPLY_SERIAL,
    SENDER,
    SIGNATURE,
    DBusWireError,
    Variant,
    marshal,
    pad,
    write_value,
)

_header_fields: dict[tuple, bytes] = {}


def message(
    kind: int,
    serial: int,
    fields: dict[int, object],
    signature: str = "",
    body: tuple | list = (),
    flags: int = 0,
) -> bytes:
    """One whole little-endian message.  ``fields``: header field code -> value (the field's
    type is fixed by the specification); SIGNATURE is added from ``signature``."""
    if not 0 < serial < 1 << 32:
        raise DBusWireError(f"serial {serial} is not a nonzero uint32")
    data = marshal(signature, body) if signature else b""
    key = (tuple(sorted(fields.items())), signature)
    tail = _header_fields.get(key)
    if tail is None:
        items = [(code, Variant(FIELD_TYPES[code], value)) for code, value in key[0]]
        if signature:
            items.append((SIGNATURE, Variant("g", signature)))
        header = bytearray(12)
        write_value(header, ("a", ("(", ("y", "v"))), items)
        pad(header, 8)
        tail = bytes(header[12:])
        if REPLY_SERIAL not in fields and len(_header_fields) < 64:
            # a caller's calls repeat their fields (path, interface, member, destination): the
            # marshalled fields are kept, so a call costs its body and 12 bytes
            _header_fields[key] = tail
    if 12 + len(tail) + len(data) > MAX_MESSAGE:
        raise DBusWireError(f"message of {12 + len(tail) + len(data)} bytes (at most 128 MiB)")
    return HEADERS[ord("l")].pack(ord("l"), kind, flags, 1, len(data), serial) + tail + data


def method_call(
    serial: int,
    destination: str | None,
    path: str,
    interface: str,
    member: str,
    signature: str = "",
    body: tuple | list = (),
    flags: int = 0,
) -> bytes:
    fields: dict[int, object] = {PATH: path, INTERFACE: interface, MEMBER: member}
    if destination is not None:
        fields[DESTINATION] = destination
    return message(METHOD_CALL, serial, fields, signature, body, flags)


def method_return(
    serial: int, reply_to: Message, signature: str = "", body: tuple | list = ()
) -> bytes:
    fields: dict[int, object] = {REPLY_SERIAL: reply_to.serial}
    if reply_to.sender is not None:
        fields[DESTINATION] = reply_to.sender
    return message(METHOD_RETURN, serial, fields, signature, body, NO_REPLY_EXPECTED)


def error(serial: int, reply_to: Message, name: str, text: str) -> bytes:
    fields: dict[int, object] = {REPLY_SERIAL: reply_to.serial, ERROR_NAME: name}
    if reply_to.sender is not None:
        fields[DESTINATION] = reply_to.sender
    return message(ERROR, serial, fields, "s", (text,), NO_REPLY_EXPECTED)


class Message:
    """One decoded message.  ``fields``: header field code -> value; ``body``: a tuple."""

    __slots__ = ("body", "fields", "flags", "serial", "type")

    def __init__(
        self, kind: int, flags: int, serial: int, fields: dict[int, object], body: tuple
    ) -> None:
        self.type = kind
        self.flags = flags
        self.serial = serial
        self.fields = fields
        self.body = body

    # unmarshal.py reads each known field by its specified type (FIELD_TYPES): REPLY_SERIAL
    # is an int, the others str; the isinstance checks say so to the type checker.

    @property
    def reply_serial(self) -> int | None:
        serial = self.fields.get(REPLY_SERIAL)
        return serial if isinstance(serial, int) else None

    def _text_field(self, code: int) -> str | None:
        value = self.fields.get(code)
        return value if isinstance(value, str) else None

    @property
    def error_name(self) -> str | None:
        return self._text_field(ERROR_NAME)

    @property
    def sender(self) -> str | None:
        return self._text_field(SENDER)

    @property
    def member(self) -> str | None:
        return self._text_field(MEMBER)

    @property
    def interface(self) -> str | None:
        return self._text_field(INTERFACE)

    @property
    def path(self) -> str | None:
        return self._text_field(PATH)

    @property
    def destination(self) -> str | None:
        return self._text_field(DESTINATION)

    @property
    def signature(self) -> str:
        return self._text_field(SIGNATURE) or ""

    def error_text(self) -> str:
        """An error reply's message (its first argument when that is a string)."""
        if self.body and isinstance(self.body[0], str):
            return self.body[0]
        return ""

    def __repr__(self) -> str:
        return f"Message(type={self.type}, serial={self.serial}, fields={self.fields!r})"


class Serials:
    """Message serials of one connection: nonzero uint32s, in order, wrapping past 2**32-1."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last = self.last % 0xFFFFFFFF + 1
        return self.last
