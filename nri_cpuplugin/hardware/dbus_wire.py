"""D-Bus messages and the SASL EXTERNAL handshake as bytes in and out (no socket here).

systemd's cgroup properties are set over D-Bus (``systemd_units.py``, docs/cgroups-and-hooks.md
§21).  The messages are built and parsed here rather than with a D-Bus library: the OCI hook is
a new process per container start, and the smallest library measured costs it several times
what this module does to import (docs/benchmarks.md, "D-Bus clients"; docs/architecture.md,
"What we wrote ourselves").  Only what talking to systemd needs is here: the message header,
the types ``y b n q i u x t d h s o g``, arrays (``ay`` as bytes), structs, dict entries and
variants, on both byte orders; no file descriptor passing.

Layout (D-Bus specification, "Message Format"): a 12-byte fixed header {byte endianness ``l`` or
``B``, byte type, byte flags, byte protocol version 1, uint32 body length, uint32 serial}, then
the header fields as ``a(yv)``, padded to 8 bytes, then the body, marshalled by the SIGNATURE
field.  Every value is aligned to its type's natural boundary counted from the start of the
message (the body starts 8-aligned, so offsets within it align the same way).

Everything read comes from another process: lengths are checked against what is there and
against the specification's limits (message 128 MiB, array 64 MiB, signature 255, nesting 32
arrays + 32 structs), and any violation is a ``DBusWireError``, never an IndexError or a wait
for bytes that will not come.
"""

from __future__ import annotations

import struct

from ..base.errors import PluginError

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeAlias

    # A complete type as parse_signature gives it: a type code (a basic type or "v"), or
    # ("a", element), ("(", fields), ("{", key, value).
    _Node: TypeAlias = str | tuple[Any, ...]

# message types
METHOD_CALL, METHOD_RETURN, ERROR, SIGNAL = 1, 2, 3, 4
# flags
NO_REPLY_EXPECTED, NO_AUTO_START, ALLOW_INTERACTIVE_AUTHORIZATION = 0x1, 0x2, 0x4
# header field codes
PATH, INTERFACE, MEMBER, ERROR_NAME, REPLY_SERIAL, DESTINATION, SENDER, SIGNATURE, UNIX_FDS = range(
    1, 10
)
_FIELD_TYPES = {
    PATH: "o",
    INTERFACE: "s",
    MEMBER: "s",
    ERROR_NAME: "s",
    REPLY_SERIAL: "u",
    DESTINATION: "s",
    SENDER: "s",
    SIGNATURE: "g",
    UNIX_FDS: "u",
}
# what each message type must carry (specification, "Message Types")
_REQUIRED = {
    METHOD_CALL: (PATH, MEMBER),
    METHOD_RETURN: (REPLY_SERIAL,),
    ERROR: (ERROR_NAME, REPLY_SERIAL),
    SIGNAL: (PATH, INTERFACE, MEMBER),
}

MAX_MESSAGE = 1 << 27
MAX_ARRAY = 1 << 26
MAX_SIGNATURE = 255
MAX_DEPTH = 32  # arrays and structs each; variants count towards the total of 64

_FIXED = {  # type code -> (struct format, size); alignment = size
    "y": ("B", 1),
    "b": ("I", 4),
    "n": ("h", 2),
    "q": ("H", 2),
    "i": ("i", 4),
    "u": ("I", 4),
    "x": ("q", 8),
    "t": ("Q", 8),
    "d": ("d", 8),
    "h": ("I", 4),
}
_ALIGN = {"s": 4, "o": 4, "g": 1, "a": 4, "(": 8, "{": 8, "v": 1}
for _code, (_fmt, _size) in _FIXED.items():
    _ALIGN[_code] = _size
_BASIC = frozenset("ybnqiuxtdhsog")
_HEADER = {ord("l"): struct.Struct("<BBBBII"), ord("B"): struct.Struct(">BBBBII")}


class DBusWireError(PluginError, ValueError):
    """Bytes that are not a well-formed D-Bus message or handshake line, or a value that cannot
    be marshalled."""

    code = "dbus"


class Variant:
    """A ``v`` value: its own signature (one complete type) and the value."""

    __slots__ = ("signature", "value")

    def __init__(self, signature: str, value: object) -> None:
        self.signature = signature
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Variant)
            and self.signature == other.signature
            and self.value == other.value
        )

    def __hash__(self) -> int:
        return hash((self.signature, repr(self.value)))

    def __repr__(self) -> str:
        return f"Variant({self.signature!r}, {self.value!r})"


# --- signatures -----------------------------------------------------------------------------

_parsed: dict[str, tuple[_Node, ...]] = {}


def parse_signature(signature: str) -> tuple[_Node, ...]:
    """The complete types of ``signature`` as a tree: a type code string for basic types and
    ``v``, ``("a", element)``, ``("(", fields)``, ``("{", key, value)``.  Parsed once per
    distinct signature (a reply's signatures repeat)."""
    tree = _parsed.get(signature)
    if tree is None:
        if len(signature) > MAX_SIGNATURE:
            raise DBusWireError(f"signature of {len(signature)} characters (at most 255)")
        types = []
        position = 0
        while position < len(signature):
            node, position = _complete_type(signature, position, 0, 0)
            types.append(node)
        tree = tuple(types)
        if len(_parsed) < 256:  # a peer choosing signatures cannot grow it without bound
            _parsed[signature] = tree
    return tree


def _complete_type(signature: str, position: int, arrays: int, structs: int) -> tuple[_Node, int]:
    code = signature[position]
    if code in _BASIC or code == "v":
        return code, position + 1
    if code == "a":
        if arrays >= MAX_DEPTH:
            raise DBusWireError(f"signature {signature!r} nests arrays deeper than 32")
        if position + 1 >= len(signature):
            raise DBusWireError(f"signature {signature!r} ends inside an array")
        if signature[position + 1] == "{":
            return _dict_entry(signature, position + 1, arrays + 1, structs)
        element, end = _complete_type(signature, position + 1, arrays + 1, structs)
        return ("a", element), end
    if code == "(":
        if structs >= MAX_DEPTH:
            raise DBusWireError(f"signature {signature!r} nests structs deeper than 32")
        fields = []
        position += 1
        while position < len(signature) and signature[position] != ")":
            field, position = _complete_type(signature, position, arrays, structs + 1)
            fields.append(field)
        if position >= len(signature) or not fields:
            raise DBusWireError(f"signature {signature!r} has an unclosed or empty struct")
        return ("(", tuple(fields)), position + 1
    raise DBusWireError(f"signature {signature!r}: {code!r} is not a type here")


def _dict_entry(signature: str, position: int, arrays: int, structs: int) -> tuple[_Node, int]:
    # a{kv}: only directly inside an array, a basic key, exactly one value
    if structs >= MAX_DEPTH:
        raise DBusWireError(f"signature {signature!r} nests structs deeper than 32")
    if position + 1 >= len(signature) or signature[position + 1] not in _BASIC:
        raise DBusWireError(f"signature {signature!r}: a dict entry needs a basic key type")
    key = signature[position + 1]
    value, end = _complete_type_checked(signature, position + 2, arrays, structs + 1)
    if end >= len(signature) or signature[end] != "}":
        raise DBusWireError(f"signature {signature!r}: a dict entry holds one key and one value")
    return ("a", ("{", key, value)), end + 1


def _complete_type_checked(
    signature: str, position: int, arrays: int, structs: int
) -> tuple[_Node, int]:
    if position >= len(signature):
        raise DBusWireError(f"signature {signature!r} ends inside a dict entry")
    return _complete_type(signature, position, arrays, structs)


# --- marshalling ----------------------------------------------------------------------------


def _pad(buf: bytearray, alignment: int) -> None:
    buf += b"\0" * (-len(buf) % alignment)


# value (here and in the _write_* below): what the caller gave for the type node; only the
# signature, at run time, says its shape (Any: a value of the wrong shape raises as Python does
# with it)
def _write(buf: bytearray, node: _Node, value: Any) -> None:
    if isinstance(node, str):
        _WRITE_BASIC[node](buf, node, value)
    elif node[0] == "a":
        _write_array(buf, node[1], value)
    else:  # struct
        _write_struct(buf, node[1], value)


def _write_fixed(buf: bytearray, code: str, value: Any) -> None:
    fmt, size = _FIXED[code]
    _pad(buf, size)
    try:
        buf += struct.pack("<" + fmt, value)
    except struct.error as e:
        raise DBusWireError(f"{value!r} does not fit D-Bus type {code!r}: {e}") from None


def _write_boolean(buf: bytearray, code: str, value: Any) -> None:
    _write_fixed(buf, code, 1 if value else 0)


def _write_string(buf: bytearray, code: str, value: Any) -> None:  # s, o
    data = _text(value, code)
    _pad(buf, 4)
    buf += struct.pack("<I", len(data)) + data + b"\0"


def _write_signature(buf: bytearray, code: str, value: Any) -> None:
    parse_signature(value)
    data = _text(value, code)
    buf += bytes((len(data),)) + data + b"\0"


def _write_variant(buf: bytearray, code: str, value: Any) -> None:
    if not isinstance(value, Variant):
        raise DBusWireError(f"a variant needs a Variant, not {type(value).__name__}")
    types = parse_signature(value.signature)
    if len(types) != 1:
        raise DBusWireError(f"variant signature {value.signature!r} is not one type")
    _write_signature(buf, "g", value.signature)
    _write(buf, types[0], value.value)


_WRITE_BASIC: dict[str, Callable[[bytearray, str, Any], None]] = {
    **dict.fromkeys(_FIXED, _write_fixed),
    "b": _write_boolean,
    "s": _write_string,
    "o": _write_string,
    "g": _write_signature,
    "v": _write_variant,
}


def _write_array(buf: bytearray, element: _Node, value: Any) -> None:
    _pad(buf, 4)
    at = len(buf)
    buf += b"\0\0\0\0"
    _pad(buf, _alignment(element))
    start = len(buf)  # the length counts from the first element, after its padding
    if element == "y":
        buf += bytes(value)
    elif isinstance(element, tuple) and element[0] == "{":
        items = value.items() if isinstance(value, dict) else value
        for key, item in items:
            _pad(buf, 8)
            _write(buf, element[1], key)
            _write(buf, element[2], item)
    else:
        for item in value:
            _write(buf, element, item)
    size = len(buf) - start
    if size > MAX_ARRAY:
        raise DBusWireError(f"array of {size} bytes (at most {MAX_ARRAY})")
    struct.pack_into("<I", buf, at, size)


def _write_struct(buf: bytearray, fields: tuple[_Node, ...], value: Any) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != len(fields):
        raise DBusWireError(f"a struct of {len(fields)} fields needs as many values")
    _pad(buf, 8)
    for field, item in zip(fields, value, strict=True):
        _write(buf, field, item)


def _alignment(node: _Node) -> int:
    return _ALIGN[node if isinstance(node, str) else node[0]]


def _text(value: object, code: str) -> bytes:
    if not isinstance(value, str):
        raise DBusWireError(f"D-Bus type {code!r} needs a str, not {type(value).__name__}")
    data = value.encode()
    if b"\0" in data:
        raise DBusWireError(f"D-Bus strings cannot contain NUL: {value!r}")
    if code == "o" and not valid_object_path(value):
        raise DBusWireError(f"{value!r} is not a D-Bus object path")
    return data


def valid_object_path(path: str) -> bool:
    """``/`` or ``/`` followed by ``/``-separated non-empty elements of ``[A-Za-z0-9_]``."""
    if path == "/":
        return True
    if not path.startswith("/") or path.endswith("/"):
        return False
    for element in path[1:].split("/"):
        if not element or not (element.replace("_", "a").isalnum() and element.isascii()):
            return False
    return True


def marshal(signature: str, values: tuple | list) -> bytes:
    """The body bytes of ``values`` by ``signature`` (little-endian, starting 8-aligned)."""
    types = parse_signature(signature)
    if len(types) != len(values):
        raise DBusWireError(f"signature {signature!r} has {len(types)} types, {len(values)} values")
    buf = bytearray()
    for node, value in zip(types, values, strict=True):
        _write(buf, node, value)
    return bytes(buf)


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
        items = [(code, Variant(_FIELD_TYPES[code], value)) for code, value in key[0]]
        if signature:
            items.append((SIGNATURE, Variant("g", signature)))
        header = bytearray(12)
        _write(header, ("a", ("(", ("y", "v"))), items)
        _pad(header, 8)
        tail = bytes(header[12:])
        if REPLY_SERIAL not in fields and len(_header_fields) < 64:
            # a caller's calls repeat their fields (path, interface, member, destination): the
            # marshalled fields are kept, so a call costs its body and 12 bytes
            _header_fields[key] = tail
    if 12 + len(tail) + len(data) > MAX_MESSAGE:
        raise DBusWireError(f"message of {12 + len(tail) + len(data)} bytes (at most 128 MiB)")
    return _HEADER[ord("l")].pack(ord("l"), kind, flags, 1, len(data), serial) + tail + data


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


# --- unmarshalling --------------------------------------------------------------------------


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

    def read(self, node: _Node, depth: int) -> object:
        """The value of type ``node`` at the read position; ``depth``: the containers and
        variants it is inside."""
        if isinstance(node, str):
            if node in _FIXED:
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
        """A value of a fixed-size type (``_FIXED``)."""
        fmt, size = _FIXED[code]
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

    def array(self, element: _Node, depth: int) -> bytes | list[object] | dict[object, object]:
        """An array: its length, then its elements (at ``depth``); ``ay`` as bytes, an array of
        dict entries as a dict."""
        size = self.uint32()
        if size > MAX_ARRAY:
            raise DBusWireError(f"array of {size} bytes (at most {MAX_ARRAY})")
        self.align(_alignment(element))
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

    def elements(self, element: _Node, stop: int, depth: int) -> list[object]:
        items = []
        while self.position < stop:
            items.append(self.read(element, depth))
        return items

    def entries(self, key: _Node, value: _Node, stop: int, depth: int) -> dict[object, object]:
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
            expected = _FIELD_TYPES.get(code)
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

    # parse_message reads each known field by its specified type (_FIELD_TYPES): REPLY_SERIAL
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


def message_size(data: bytes | bytearray | memoryview, offset: int = 0) -> int | None:
    """The whole length of the message starting at ``offset``, once its first 16 bytes are
    there (None before); a fixed header that cannot start a valid message raises."""
    if len(data) - offset < 16:
        return None
    layout = _HEADER.get(data[offset])
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
    _flag, kind, flags, _version, body_size, serial = _HEADER[data[0]].unpack_from(data)
    reader = _Reader(data, 12, len(data), order)
    fields = reader.header_fields()
    reader.align(8)
    if reader.position + body_size != len(data):
        raise DBusWireError("message length does not match its header")
    if not METHOD_CALL <= kind <= SIGNAL:
        return None
    missing = [code for code in _REQUIRED[kind] if code not in fields]
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


# --- authentication -------------------------------------------------------------------------

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


class Serials:
    """Message serials of one connection: nonzero uint32s, in order, wrapping past 2**32-1."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last = self.last % 0xFFFFFFFF + 1
        return self.last
