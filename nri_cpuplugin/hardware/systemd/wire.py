"""The D-Bus wire format, sans I/O: its types and signatures, and values marshalled into bytes.

systemd's cgroup properties are set over D-Bus (``units.py``, docs/cgroups-and-hooks.md §21).  The
messages are built and parsed by this package rather than with a D-Bus library: the OCI hook is a
new process per container start, and the smallest library measured costs it several times what these
modules do to import (docs/benchmarks.md, "D-Bus clients"; docs/architecture.md, "What we wrote
ourselves").  Only what talking to systemd needs is here: the message header, the types ``y b n q i
u x t d h s o g``, arrays (``ay`` as bytes), structs, dict entries and variants, on both byte
orders; no file descriptor passing.  Whole messages are message.py; they are read back from bytes in
unmarshal.py; the authentication that opens a connection is auth.py.

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


def pad(buf: bytearray, alignment: int) -> None:
    """Zero bytes up to the next multiple of ``alignment`` (counted from the message's start)."""
    buf += b"\0" * (-len(buf) % alignment)


# value (here and in the _write_* below): what the caller gave for the type node; only the
# signature, at run time, says its shape (Any: a value of the wrong shape raises as Python does
# with it)
def write_value(buf: bytearray, node: Node, value: Any) -> None:
    """``value`` of type ``node`` appended to ``buf``, aligned from ``buf``'s start."""
    if isinstance(node, str):
        _WRITE_BASIC[node](buf, node, value)
    elif node[0] == "a":
        _write_array(buf, node[1], value)
    else:  # struct
        _write_struct(buf, node[1], value)


def _write_fixed(buf: bytearray, code: str, value: Any) -> None:
    fmt, size = FIXED[code]
    pad(buf, size)
    try:
        buf += struct.pack("<" + fmt, value)
    except struct.error as e:
        raise DBusWireError(f"{value!r} does not fit D-Bus type {code!r}: {e}") from None


def _write_boolean(buf: bytearray, code: str, value: Any) -> None:
    _write_fixed(buf, code, 1 if value else 0)


def _write_string(buf: bytearray, code: str, value: Any) -> None:  # s, o
    data = _text(value, code)
    pad(buf, 4)
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
    write_value(buf, types[0], value.value)


_WRITE_BASIC: dict[str, Callable[[bytearray, str, Any], None]] = {
    **dict.fromkeys(FIXED, _write_fixed),
    "b": _write_boolean,
    "s": _write_string,
    "o": _write_string,
    "g": _write_signature,
    "v": _write_variant,
}


def _write_array(buf: bytearray, element: Node, value: Any) -> None:
    pad(buf, 4)
    at = len(buf)
    buf += b"\0\0\0\0"
    pad(buf, alignment_of(element))
    start = len(buf)  # the length counts from the first element, after its padding
    if element == "y":
        buf += bytes(value)
    elif isinstance(element, tuple) and element[0] == "{":
        items = value.items() if isinstance(value, dict) else value
        for key, item in items:
            pad(buf, 8)
            write_value(buf, element[1], key)
            write_value(buf, element[2], item)
    else:
        for item in value:
            write_value(buf, element, item)
    size = len(buf) - start
    if size > MAX_ARRAY:
        raise DBusWireError(f"array of {size} bytes (at most {MAX_ARRAY})")
    struct.pack_into("<I", buf, at, size)


def _write_struct(buf: bytearray, fields: tuple[Node, ...], value: Any) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != len(fields):
        raise DBusWireError(f"a struct of {len(fields)} fields needs as many values")
    pad(buf, 8)
    for field, item in zip(fields, value, strict=True):
        write_value(buf, field, item)


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
        write_value(buf, node, value)
    return bytes(buf)
