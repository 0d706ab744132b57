"""The D-Bus wire format, sans I/O: its types and signatures, and values and messages marshalled
into bytes.

systemd's cgroup properties are set over D-Bus (``units.py``, docs/cgroups-and-hooks.md
§21).  The messages are built and parsed here rather than with a D-Bus library: the OCI hook is
a new process per container start, and the smallest library measured costs it several times
what these modules do to import (docs/benchmarks.md, "D-Bus clients"; docs/architecture.md,
"What we wrote ourselves").  Only what talking to systemd needs is here: the message header,
the types ``y b n q i u x t d h s o g``, arrays (``ay`` as bytes), structs, dict entries and
variants, on both byte orders; no file descriptor passing.  Messages are read back from bytes
in unmarshal.py; the authentication that opens a connection is auth.py.

Layout (D-Bus specification, "Message Format"): a 12-byte fixed header {byte endianness ``l`` or
``B``, byte type, byte flags, byte protocol version 1, uint32 body length, uint32 serial}, then
the header fields as ``a(yv)``, padded to 8 bytes, then the body, marshalled by the SIGNATURE
field.  Every value is aligned to its type's natural boundary counted from the start of the
message (the body starts 8-aligned, so offsets within it align the same way).  The limits of
the specification (message 128 MiB, array 64 MiB, signature 255, nesting 32 arrays + 32
structs) hold for what is written as for what is read; a violation is a ``DBusWireError``.
"""

from __future__ import annotations

import struct

from ...base.errors import PluginError

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeAlias

    # A complete type as parse_signature gives it: a type code (a basic type or "v"), or
    # ("a", element), ("(", fields), ("{", key, value).
    Node: TypeAlias = str | tuple[Any, ...]

# message types
METHOD_CALL, METHOD_RETURN, ERROR, SIGNAL = 1, 2, 3, 4
# flags
NO_REPLY_EXPECTED, NO_AUTO_START, ALLOW_INTERACTIVE_AUTHORIZATION = 0x1, 0x2, 0x4
# header field codes
PATH, INTERFACE, MEMBER, ERROR_NAME, REPLY_SERIAL, DESTINATION, SENDER, SIGNATURE, UNIX_FDS = range(
    1, 10
)
FIELD_TYPES = {
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
REQUIRED_FIELDS = {
    METHOD_CALL: (PATH, MEMBER),
    METHOD_RETURN: (REPLY_SERIAL,),
    ERROR: (ERROR_NAME, REPLY_SERIAL),
    SIGNAL: (PATH, INTERFACE, MEMBER),
}

MAX_MESSAGE = 1 << 27
MAX_ARRAY = 1 << 26
MAX_SIGNATURE = 255
MAX_DEPTH = 32  # arrays and structs each; variants count towards the total of 64

FIXED = {  # type code -> (struct format, size); alignment = size
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
for _code, (_fmt, _size) in FIXED.items():
    _ALIGN[_code] = _size
_BASIC = frozenset("ybnqiuxtdhsog")
HEADERS = {ord("l"): struct.Struct("<BBBBII"), ord("B"): struct.Struct(">BBBBII")}


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

_parsed: dict[str, tuple[Node, ...]] = {}


def parse_signature(signature: str) -> tuple[Node, ...]:
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


def _complete_type(signature: str, position: int, arrays: int, structs: int) -> tuple[Node, int]:
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


def _dict_entry(signature: str, position: int, arrays: int, structs: int) -> tuple[Node, int]:
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
) -> tuple[Node, int]:
    if position >= len(signature):
        raise DBusWireError(f"signature {signature!r} ends inside a dict entry")
    return _complete_type(signature, position, arrays, structs)


# --- marshalling ----------------------------------------------------------------------------


def _pad(buf: bytearray, alignment: int) -> None:
    buf += b"\0" * (-len(buf) % alignment)


# value (here and in the _write_* below): what the caller gave for the type node; only the
# signature, at run time, says its shape (Any: a value of the wrong shape raises as Python does
# with it)
def _write(buf: bytearray, node: Node, value: Any) -> None:
    if isinstance(node, str):
        _WRITE_BASIC[node](buf, node, value)
    elif node[0] == "a":
        _write_array(buf, node[1], value)
    else:  # struct
        _write_struct(buf, node[1], value)


def _write_fixed(buf: bytearray, code: str, value: Any) -> None:
    fmt, size = FIXED[code]
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
    **dict.fromkeys(FIXED, _write_fixed),
    "b": _write_boolean,
    "s": _write_string,
    "o": _write_string,
    "g": _write_signature,
    "v": _write_variant,
}


def _write_array(buf: bytearray, element: Node, value: Any) -> None:
    _pad(buf, 4)
    at = len(buf)
    buf += b"\0\0\0\0"
    _pad(buf, alignment_of(element))
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


def _write_struct(buf: bytearray, fields: tuple[Node, ...], value: Any) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != len(fields):
        raise DBusWireError(f"a struct of {len(fields)} fields needs as many values")
    _pad(buf, 8)
    for field, item in zip(fields, value, strict=True):
        _write(buf, field, item)


def alignment_of(node: Node) -> int:
    """The boundary a value of type ``node`` starts on."""
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
        items = [(code, Variant(FIELD_TYPES[code], value)) for code, value in key[0]]
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
