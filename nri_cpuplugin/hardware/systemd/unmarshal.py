"""D-Bus messages read from bytes, sans I/O: a byte stream cut into whole messages, each checked
and decoded into a ``Message`` (wire.py has the format).

Everything read comes from another process: lengths are checked against what is there and
against the specification's limits (message 128 MiB, array 64 MiB, signature 255, nesting 32
arrays + 32 structs), and any violation is a ``DBusWireError``, never an IndexError or a wait
for bytes that will not come.
"""

from __future__ import annotations

import struct

from .message import Message
from .wire import (
    FIELD_TYPES,
    FIXED,
    HEADERS,
    MAX_ARRAY,
    MAX_DEPTH,
    MAX_MESSAGE,
    METHOD_CALL,
    REQUIRED_FIELDS,
    SIGNAL,
    SIGNATURE,
    DBusWireError,
    Variant,
    alignment_of,
    parse_signature,
    valid_object_path,
)

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from .wire import Node


class _Reader:
    __slots__ = ("data", "end", "order", "position", "variants")

    def __init__(self, data: bytes, position: int, end: int, order: str) -> None:
        self.data = data
        self.position = position
        self.end = end
        self.order = order
        self.variants = 0

    def align(self, alignment: int) -> None:
        start = self.position
        target = start + (-start % alignment)
        self.need(target - start)
        if any(self.data[start:target]):
            raise DBusWireError(f"nonzero padding at offset {start}")
        self.position = target

    def need(self, size: int) -> None:
        if size > self.end - self.position:
            raise DBusWireError(
                f"value of {size} bytes at offset {self.position} overruns the message"
            )

    def read(self, node: Node, depth: int) -> object:
        """The value of type ``node`` at the read position; ``depth``: the containers and
        variants it is inside."""
        if isinstance(node, str):
            if node in FIXED:
                return self.boolean() if node == "b" else self.number(node)
            if node == "g":
                return self.signature()
            if node == "v":
                return self.variant(depth + 1)
            return self.string(node)  # s, o
        if depth + 1 > 2 * MAX_DEPTH:
            raise DBusWireError("values nest deeper than 64")
        if node[0] == "a":
            return self.array(node[1], depth + 1)
        self.align(8)  # a struct
        return tuple(self.read(field, depth + 1) for field in node[1])

    def number(self, code: str) -> int | float:
        """A value of a fixed-size type (``FIXED``)."""
        fmt, size = FIXED[code]
        self.align(size)
        self.need(size)
        value: int | float = struct.unpack_from(self.order + fmt, self.data, self.position)[0]
        self.position += size
        return value

    def boolean(self) -> bool:
        value = self.number("b")
        if value > 1:
            raise DBusWireError(f"boolean {value} is neither 0 nor 1")
        return bool(value)

    def uint32(self) -> int:
        """A string's or an array's length."""
        self.align(4)
        self.need(4)
        size: int = struct.unpack_from(self.order + "I", self.data, self.position)[0]
        self.position += 4
        return size

    def string(self, code: str) -> str:  # s, o
        text = self.text(self.uint32())
        if code == "o" and not valid_object_path(text):
            raise DBusWireError(f"{text!r} is not a D-Bus object path")
        return text

    def variant(self, depth: int) -> Variant:
        """A ``v``: its signature, then its value at ``depth``."""
        signature = self.signature()
        types = parse_signature(signature)
        if len(types) != 1:
            raise DBusWireError(f"variant signature {signature!r} is not one complete type")
        self.variants += 1
        if depth > 2 * MAX_DEPTH:
            raise DBusWireError("values nest deeper than 64")
        return Variant(signature, self.read(types[0], depth))

    def array(self, element: Node, depth: int) -> bytes | list[object] | dict[object, object]:
        """An array: its length, then its elements (at ``depth``); ``ay`` as bytes, an array of
        dict entries as a dict."""
        size = self.uint32()
        if size > MAX_ARRAY:
            raise DBusWireError(f"array of {size} bytes (at most {MAX_ARRAY})")
        self.align(alignment_of(element))
        self.need(size)
        stop = self.position + size
        if element == "y":
            data = bytes(self.data[self.position : stop])
            self.position = stop
            return data
        items: list[object] | dict[object, object]
        if isinstance(element, tuple) and element[0] == "{":
            items = self.entries(element[1], element[2], stop, depth)
        else:
            items = self.elements(element, stop, depth)
        if self.position != stop:
            raise DBusWireError(f"array elements overrun its length of {size} bytes")
        return items

    def elements(self, element: Node, stop: int, depth: int) -> list[object]:
        items = []
        while self.position < stop:
            items.append(self.read(element, depth))
        return items

    def entries(self, key: Node, value: Node, stop: int, depth: int) -> dict[object, object]:
        items = {}
        while self.position < stop:
            self.align(8)
            entry = self.read(key, depth)
            items[entry] = self.read(value, depth)
        return items

    def header_fields(self) -> dict[int, object]:
        """The ``a(yv)`` of header fields, known codes by their specified types (a fast path:
        every message has them); unknown codes are read generically and ignored, as the
        specification asks."""
        self.need(4)
        (size,) = struct.unpack_from(self.order + "I", self.data, self.position)
        self.position += 4
        if size > MAX_ARRAY:
            raise DBusWireError(f"header fields of {size} bytes (at most {MAX_ARRAY})")
        self.align(8)
        self.need(size)
        stop = self.position + size
        fields: dict[int, object] = {}
        while self.position < stop:
            self.align(8)
            self.need(1)
            code = self.data[self.position]
            self.position += 1
            signature = self.signature()
            expected = FIELD_TYPES.get(code)
            if expected is None:
                types = parse_signature(signature)
                if len(types) != 1:
                    raise DBusWireError(f"header field {code} has signature {signature!r}")
                self.read(types[0], 1)
                continue
            if signature != expected:
                raise DBusWireError(f"header field {code} has type {signature!r}, not {expected!r}")
            fields[code] = self.read(expected, 1)
        if self.position != stop:
            raise DBusWireError(f"header fields overrun their length of {size} bytes")
        return fields

    def signature(self) -> str:
        """A ``g`` value, checked to be a valid signature."""
        self.need(1)
        size = self.data[self.position]
        self.position += 1
        text = self.text(size)
        parse_signature(text)
        return text

    def text(self, size: int) -> str:
        self.need(size + 1)
        raw = self.data[self.position : self.position + size]
        if self.data[self.position + size] != 0 or 0 in raw:
            raise DBusWireError(f"string at offset {self.position} is not NUL-terminated")
        self.position += size + 1
        try:
            return bytes(raw).decode()
        except UnicodeDecodeError:
            raise DBusWireError(f"string at offset {self.position} is not UTF-8") from None


def message_size(data: bytes | bytearray | memoryview, offset: int = 0) -> int | None:
    """The whole length of the message starting at ``offset``, once its first 16 bytes are
    there (None before); a fixed header that cannot start a valid message raises."""
    if len(data) - offset < 16:
        return None
    layout = HEADERS.get(data[offset])
    if layout is None:
        raise DBusWireError(
            f"byte order flag {data[offset]:#04x} is neither 'l' nor 'B': not a D-Bus message"
        )
    _order, _kind, _flags, version, body, serial = layout.unpack_from(data, offset)
    if version != 1:
        raise DBusWireError(f"protocol version {version} (only 1 exists)")
    (fields,) = struct.unpack_from("<I" if data[offset] == ord("l") else ">I", data, offset + 12)
    if fields > MAX_ARRAY:
        raise DBusWireError(f"header fields of {fields} bytes (at most {MAX_ARRAY})")
    size: int = 16 + fields + (-(16 + fields) % 8) + body
    if size > MAX_MESSAGE:
        raise DBusWireError(f"message of {size} bytes (at most {MAX_MESSAGE})")
    if serial == 0:
        raise DBusWireError("message serial 0")
    return size


def parse_message(data: bytes) -> Message | None:
    """The message that is exactly ``data`` (``message_size`` bytes).  None for a message of a
    type this protocol version does not define, which the specification says to ignore."""
    order = "<" if data[0] == ord("l") else ">"
    _flag, kind, flags, _version, body_size, serial = HEADERS[data[0]].unpack_from(data)
    reader = _Reader(data, 12, len(data), order)
    fields = reader.header_fields()
    reader.align(8)
    if reader.position + body_size != len(data):
        raise DBusWireError("message length does not match its header")
    if not METHOD_CALL <= kind <= SIGNAL:
        return None
    missing = [code for code in REQUIRED_FIELDS[kind] if code not in fields]
    if missing:
        raise DBusWireError(f"message of type {kind} lacks header fields {missing}")
    signature = fields.get(SIGNATURE, "")
    assert isinstance(signature, str)  # header_fields reads SIGNATURE as a "g": a str
    body: tuple = ()
    if body_size or signature:
        body = tuple(reader.read(node, 0) for node in parse_signature(signature))
        if reader.position != len(data):
            raise DBusWireError(f"body does not match its signature {signature!r}")
    return Message(kind, flags, serial, fields, body)


class MessageReader:
    """Messages from a byte stream, sans I/O: ``feed`` bytes as they arrive, then take the whole
    messages ``messages()`` returns.  ``limit`` bounds one message (a peer announcing more is
    refused before its bytes are waited for)."""

    __slots__ = ("buffer", "limit")

    def __init__(self, limit: int = MAX_MESSAGE) -> None:
        self.buffer = bytearray()
        self.limit = min(limit, MAX_MESSAGE)

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def messages(self) -> list[Message]:
        out = []
        offset = 0
        buffer = self.buffer
        try:
            while True:
                size = message_size(buffer, offset)
                if size is None:
                    break
                if size > self.limit:
                    raise DBusWireError(f"message of {size} bytes (this reader takes {self.limit})")
                if len(buffer) - offset < size:
                    break
                decoded = parse_message(bytes(buffer[offset : offset + size]))
                offset += size
                if decoded is not None:
                    out.append(decoded)
        finally:
            del buffer[:offset]
        return out
