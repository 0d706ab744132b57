"""The D-Bus wire format (nri_cpuplugin/hardware/systemd/: wire.py, unmarshal.py, auth.py)
against the specification.

Expected bytes are written out by hand from the specification's rules ("Message Format",
"Marshaling (Wire Format)"): little-endian, every value aligned to its size counted from the
start of the message, strings as uint32 length + bytes + NUL, signatures as byte length + bytes
+ NUL, arrays as uint32 byte length, then padding to the element's alignment (present even when
empty, not counted in the length), structs and dict entries 8-aligned, variants as a signature
followed by the value.  Round trips go through jeepney too, an independent implementation.
Malformed input must fail with DBusWireError, at once: never another exception, never a wait.
"""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jeepney.low_level import Parser as JeepneyParser

from nri_cpuplugin.hardware.systemd import message as msg
from nri_cpuplugin.hardware.systemd import wire
from nri_cpuplugin.hardware.systemd.auth import auth_external, auth_reply
from nri_cpuplugin.hardware.systemd.unmarshal import MessageReader
from nri_cpuplugin.hardware.systemd.wire import DBusWireError, Variant


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


# --- marshalling, byte for byte ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("signature", "values", "expected"),
    [
        ("y", (7,), b"\x07"),
        ("b", (True,), u32(1)),
        ("b", (False,), u32(0)),
        ("n", (-2,), b"\xfe\xff"),
        ("q", (513,), b"\x01\x02"),
        ("i", (-1,), b"\xff\xff\xff\xff"),
        ("u", (0x01020304,), b"\x04\x03\x02\x01"),
        ("x", (-1,), b"\xff" * 8),
        ("t", (1 << 40,), b"\0\0\0\0\0\x01\0\0"),
        ("d", (1.0,), struct.pack("<d", 1.0)),
        ("s", ("foo",), u32(3) + b"foo\0"),
        ("s", ("",), u32(0) + b"\0"),
        ("o", ("/org/x",), u32(6) + b"/org/x\0"),
        ("g", ("a(sv)",), b"\x05a(sv)\0"),
        # a byte then a uint32: three bytes of padding before the uint32
        ("yu", (1, 2), b"\x01\0\0\0" + u32(2)),
        # a string's NUL then a byte: no padding (bytes align to 1)
        ("sy", ("ab", 9), u32(2) + b"ab\0\x09"),
        ("ay", (b"\x01\x02\x03",), u32(3) + b"\x01\x02\x03"),
        ("ay", (b"",), u32(0)),
        # 8-byte elements: the length (4 bytes) is followed by 4 bytes of padding, not counted
        ("at", ([5],), u32(8) + b"\0" * 4 + struct.pack("<Q", 5)),
        ("at", ([],), u32(0) + b"\0" * 4),
        # each string 4-aligned: "a" and its NUL end at 10, two bytes of padding
        ("as", (["a", "bc"],), u32(15) + u32(1) + b"a\0\0\0" + u32(2) + b"bc\0"),
        # a struct starts 8-aligned: after a byte, 7 bytes of padding
        ("y(yy)", (1, (2, 3)), b"\x01" + b"\0" * 7 + b"\x02\x03"),
        ("a{sy}", ({"k": 4},), u32(7) + b"\0" * 4 + u32(1) + b"k\0\x04"),
        # a variant is its signature, then its value aligned for its own type
        ("v", (Variant("u", 7),), b"\x01u\0\0" + u32(7)),
        ("v", (Variant("ay", b"\x06"),), b"\x02ay\0" + u32(1) + b"\x06"),
    ],
)
def test_marshal_matches_the_specification(signature: str, values: tuple, expected: bytes) -> None:
    assert wire.marshal(signature, values) == expected


def test_set_unit_properties_body_byte_for_byte() -> None:
    body = wire.marshal("sba(sv)", ("u.scope", True, [("AllowedCPUs", Variant("ay", b"\x06"))]))
    expected = (
        u32(7) + b"u.scope\0"  # s, offsets 0-11
        + u32(1)  # b at 12
        + u32(25) + b"\0" * 4  # array length at 16, padding to the struct's 8 at 20-23
        + u32(11) + b"AllowedCPUs\0"  # struct at 24: its string, to 40
        + b"\x02ay\0"  # variant signature, to 44
        + u32(1) + b"\x06"  # ay at 44; the array ends at 49: length 49 - 24
    )  # fmt: skip
    assert body == expected


def test_method_call_header_byte_for_byte() -> None:
    data = msg.message(wire.METHOD_CALL, 1, {wire.PATH: "/o", wire.MEMBER: "M"})
    expected = (
        b"l\x01\x00\x01" + u32(0) + u32(1)  # little-endian, method call, no flags, version 1
        + u32(26)  # header fields array: from offset 16 to 42
        + b"\x01\x01o\0" + u32(2) + b"/o\0"  # PATH (1) as variant 'o', ends at 27
        + b"\0" * 5  # next struct 8-aligned at 32
        + b"\x03\x01s\0" + u32(1) + b"M\0"  # MEMBER (3) as variant 's', ends at 42
        + b"\0" * 6  # the header is padded to 48; the (empty) body would start there
    )  # fmt: skip
    assert data == expected


def test_the_body_follows_the_8_aligned_header() -> None:
    data = msg.method_call(5, "d.e", "/p", "i.f", "M", "u", (3,))
    header_end = len(data) - 4
    assert header_end % 8 == 0
    assert data[header_end:] == u32(3)
    assert data[4:8] == u32(4)  # body length
    assert data[8:12] == u32(5)  # serial


def test_big_endian_messages_are_read() -> None:
    def be(n: int) -> bytes:
        return struct.pack(">I", n)

    fields = b"\x05\x01u\0" + be(7) + b"\x08\x01g\0\x01u\0"  # REPLY_SERIAL 7; SIGNATURE "u"
    data = b"B\x02\x00\x01" + be(4) + be(5) + be(len(fields)) + fields + b"\0" + be(42)
    assert len(data) % 8 == 4 and (len(data) - 4) % 8 == 0
    reader = MessageReader()
    reader.feed(data)
    [message] = reader.messages()
    assert (message.type, message.serial, message.reply_serial, message.body) == (
        wire.METHOD_RETURN,
        5,
        7,
        (42,),
    )


# --- round trips ------------------------------------------------------------------------------

SIGNATURES = {
    "y": st.integers(0, 255),
    "b": st.booleans(),
    "n": st.integers(-(1 << 15), (1 << 15) - 1),
    "q": st.integers(0, (1 << 16) - 1),
    "i": st.integers(-(1 << 31), (1 << 31) - 1),
    "u": st.integers(0, (1 << 32) - 1),
    "x": st.integers(-(1 << 63), (1 << 63) - 1),
    "t": st.integers(0, (1 << 64) - 1),
    "s": st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",))),
    "ay": st.binary(max_size=64),
    "as": st.lists(st.text(alphabet="abc", max_size=5), max_size=5),
    "a(sv)": st.lists(
        st.tuples(
            st.text(alphabet="AllowedCPUs", max_size=12),
            st.one_of(
                st.binary(max_size=8).map(lambda b: Variant("ay", b)),
                st.integers(0, 9).map(lambda n: Variant("u", n)),
                st.booleans().map(lambda b: Variant("b", b)),
            ),
        ),
        max_size=4,
    ),
    "a{su}": st.dictionaries(st.text(alphabet="xyz", max_size=3), st.integers(0, 99), max_size=4),
    "(yst)": st.tuples(st.integers(0, 255), st.text(alphabet="q", max_size=3), st.integers(0, 9)),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, tuple]:
    codes = draw(st.lists(st.sampled_from(sorted(SIGNATURES)), min_size=1, max_size=5))
    return "".join(codes), tuple(draw(SIGNATURES[code]) for code in codes)


@settings(max_examples=300, deadline=None)
@given(bodies(), st.integers(1, (1 << 32) - 1))
def test_messages_round_trip_and_jeepney_reads_them(body: tuple[str, tuple], serial: int) -> None:
    signature, values = body
    data = msg.method_call(serial, "org.x", "/a/b_c", "org.x.I", "Member", signature, values)
    reader = MessageReader()
    reader.feed(data)
    [message] = reader.messages()
    assert message.serial == serial and message.signature == signature
    assert message.path == "/a/b_c" and message.member == "Member"
    assert message.body == tuple(_plain(signature, values))
    [theirs] = JeepneyParser().feed(data)  # an independent reader agrees
    assert theirs.header.serial == serial
    assert _from_jeepney(theirs.body) == _from_jeepney(message.body)


def _plain(signature: str, values: tuple) -> list:
    # what reading gives back: lists for arrays (bytes for ay), tuples for structs
    out = []
    for code, value in zip(wire.parse_signature(signature), values, strict=True):
        if code == ("a", "y"):
            out.append(bytes(value))
        elif isinstance(code, tuple) and code[0] == "a" and not isinstance(value, dict):
            out.append([tuple(v) if isinstance(v, tuple) else v for v in value])
        else:
            out.append(value)
    return out


def _from_jeepney(value: object) -> object:
    if isinstance(value, Variant):
        return [value.signature, _from_jeepney(value.value)]  # jeepney: a (signature, value)
    if isinstance(value, (list, tuple)):
        return [_from_jeepney(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_jeepney(v) for k, v in value.items()}
    return value


def test_replies_and_errors_round_trip() -> None:
    call_bytes = msg.method_call(3, "d.e", "/p", "i.f", "M")
    reader = MessageReader()
    reader.feed(call_bytes)
    [call] = reader.messages()
    reader.feed(msg.method_return(9, call, "s", (":1.4",)) + msg.error(10, call, "a.B", "no"))
    ret, err = reader.messages()
    assert (ret.type, ret.reply_serial, ret.body) == (wire.METHOD_RETURN, 3, (":1.4",))
    assert (err.type, err.reply_serial, err.error_name, err.error_text()) == (
        wire.ERROR,
        3,
        "a.B",
        "no",
    )


def test_a_stream_split_anywhere_gives_the_same_messages() -> None:
    data = b"".join(
        msg.method_call(n, "d.e", "/p", "i.f", "M", "su", ("x" * n, n)) for n in (1, 2, 3)
    )
    for cut in range(len(data) + 1):
        reader = MessageReader()
        reader.feed(data[:cut])
        first = reader.messages()
        reader.feed(data[cut:])
        assert [m.serial for m in first + reader.messages()] == [1, 2, 3]


def test_unknown_header_fields_are_ignored() -> None:
    data = bytearray(msg.method_call(1, "d.e", "/p", "i.f", "M"))
    # rewrite DESTINATION (code 6, a string) as code 77: unknown, so skipped
    at = data.index(b"\x06\x01s\0")
    data[at] = 77
    reader = MessageReader()
    reader.feed(bytes(data))
    [message] = reader.messages()
    assert message.destination is None and message.member == "M"


def test_serials_are_nonzero_and_wrap() -> None:
    serials = msg.Serials()
    assert [serials.next() for _ in range(3)] == [1, 2, 3]
    serials.last = 0xFFFFFFFF
    assert serials.next() == 1


# --- authentication ---------------------------------------------------------------------------


def test_auth_external_sends_the_uid_as_hex_digits_and_begins() -> None:
    assert auth_external(0) == b"\0AUTH EXTERNAL 30\r\nBEGIN\r\n"
    assert auth_external(1000) == b"\0AUTH EXTERNAL 31303030\r\nBEGIN\r\n"


def test_auth_reply() -> None:
    assert auth_reply(b"OK 1234de") is None  # not a whole line yet
    guid = "0123456789abcdef0123456789abcdef"
    assert auth_reply(f"OK {guid}\r\nl\x02".encode()) == (guid, 37)
    with pytest.raises(DBusWireError, match=r"refused EXTERNAL.*ANONYMOUS"):
        auth_reply(b"REJECTED ANONYMOUS\r\n")
    with pytest.raises(DBusWireError, match="unexpected authentication answer"):
        auth_reply(b"DATA 00\r\n")
    with pytest.raises(DBusWireError, match="unexpected"):
        auth_reply(b"OK not-hex\r\n")
    with pytest.raises(DBusWireError, match="longer than 512"):
        auth_reply(b"O" * 600)


# --- malformed input --------------------------------------------------------------------------

GOOD = msg.method_call(
    2, "org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
    "SetUnitProperties", "sba(sv)", ("a.scope", True, [("AllowedCPUs", Variant("ay", b"\x03"))]),
)  # fmt: skip


def _read(data: bytes, limit: int = wire.MAX_MESSAGE) -> list:
    reader = MessageReader(limit)
    reader.feed(data)
    return reader.messages()


def test_every_truncation_waits_for_more_and_raises_nothing() -> None:
    for cut in range(len(GOOD)):
        assert _read(GOOD[:cut]) == []


@pytest.mark.parametrize("flag", [b"x", b"L", b"\0", b"b"])
def test_a_wrong_byte_order_flag_is_refused_at_once(flag: bytes) -> None:
    with pytest.raises(DBusWireError, match="byte order flag"):
        _read(flag + GOOD[1:16])  # only the fixed header: refused before the rest arrives


def test_a_wrong_protocol_version_or_serial_is_refused() -> None:
    with pytest.raises(DBusWireError, match="protocol version 2"):
        _read(GOOD[:3] + b"\x02" + GOOD[4:])
    with pytest.raises(DBusWireError, match="serial 0"):
        _read(GOOD[:8] + u32(0) + GOOD[12:])


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (4, 1 << 31, "at most"),  # body length past the 128 MiB limit
        (12, 1 << 30, "header fields of"),  # header fields array past 64 MiB
    ],
)
def test_huge_lengths_are_refused_before_their_bytes_are_awaited(
    offset: int, value: int, match: str
) -> None:
    data = GOOD[:offset] + u32(value) + GOOD[offset + 4 :]
    with pytest.raises(DBusWireError, match=match):
        _read(data[:16])


def test_a_reader_limit_refuses_bigger_messages_from_the_fixed_header() -> None:
    with pytest.raises(DBusWireError, match="this reader takes 64"):
        _read(GOOD[:16], limit=64)


def test_lengths_that_overrun_the_message_are_refused() -> None:
    body_start = len(GOOD) - wire.struct.unpack_from("<I", GOOD, 4)[0]
    for offset, value in ((body_start, 1 << 20), (body_start + 16, 1 << 25)):  # string, array
        data = GOOD[:offset] + u32(value) + GOOD[offset + 4 :]
        with pytest.raises(DBusWireError, match="overrun"):
            _read(data)


@pytest.mark.parametrize(
    "signature",
    [
        *("a", "(", "()", "(y", "a{vs}", "a{s}", "a{sss}", "{ss}", "z", "y" * 256),
        "a" * 33 + "y",
        "(" * 33 + "y" + ")" * 33,
    ],
)
def test_bad_signatures_are_refused(signature: str) -> None:
    with pytest.raises(DBusWireError):
        wire.parse_signature(signature)


def test_a_bad_signature_in_a_message_is_refused() -> None:
    at = GOOD.index(b"\x07sba(sv)\0")
    data = GOOD[:at] + b"\x07sba(zv)\0" + GOOD[at + 9 :]
    with pytest.raises(DBusWireError, match="not a type"):
        _read(data)


@pytest.mark.parametrize(
    ("signature", "data", "match"),
    [
        ("b", u32(2), "neither 0 nor 1"),
        ("s", u32(2) + b"ab", "overruns"),  # no NUL
        ("s", u32(2) + b"abX", "NUL-terminated"),
        ("s", u32(2) + b"\xff\xfe\0", "UTF-8"),
        ("o", u32(2) + b"a/\0", "object path"),
        ("yu", b"\x01\x01\0\0" + u32(1), "padding"),
        ("v", b"\x02yy\0\x01\x02", "one complete type"),
        ("ay", u32(4) + b"\x01", "overruns"),
        ("ai", u32(3) + b"\x01\0\0\0", "overrun"),
    ],
)
def test_malformed_values_are_refused(signature: str, data: bytes, match: str) -> None:
    with pytest.raises(DBusWireError, match=match):
        _read(_raw(signature, data))


def _raw(signature: str, body: bytes) -> bytes:
    """A well-formed header announcing ``signature`` and ``body``, whatever the body is."""
    fields = {wire.PATH: "/p", wire.MEMBER: "M", wire.SIGNATURE: signature}
    head = msg.message(wire.METHOD_CALL, 1, fields)
    return head[:4] + u32(len(body)) + head[8:] + body


def test_missing_required_header_fields_are_refused() -> None:
    data = msg.message(wire.METHOD_RETURN, 1, {wire.REPLY_SERIAL: 1})
    no_reply_serial = data.replace(b"\x05\x01u\0", b"\x63\x01u\0")  # made unknown
    with pytest.raises(DBusWireError, match="lacks header fields"):
        _read(no_reply_serial)


def test_a_header_field_of_the_wrong_type_is_refused() -> None:
    data = msg.message(wire.METHOD_RETURN, 1, {wire.REPLY_SERIAL: 1})
    with pytest.raises(DBusWireError, match="has type 'i'"):
        _read(data.replace(b"\x05\x01u\0", b"\x05\x01i\0"))


def test_deep_variants_are_refused() -> None:
    value: object = 1
    signature = "u"
    for _ in range(70):
        value, signature = Variant(signature, value), "v"
    data = msg.message(wire.METHOD_CALL, 1, {wire.PATH: "/p", wire.MEMBER: "M"}, "v", (value,))
    with pytest.raises(DBusWireError, match="deeper than 64"):
        _read(data)


@settings(max_examples=500)
@given(st.data())
def test_corrupted_messages_fail_cleanly(data: st.DataObject) -> None:
    raw = bytearray(GOOD)
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(DBusWireError):
        _read(bytes(raw))


@settings(max_examples=300)
@given(st.binary(min_size=16, max_size=200))
def test_random_bytes_fail_cleanly(raw: bytes) -> None:
    with contextlib.suppress(DBusWireError):
        _read(b"l" + raw[1:])


@pytest.mark.parametrize(
    ("signature", "values", "match"),
    [
        ("y", (256,), "does not fit"),
        ("s", ("a\0b",), "NUL"),
        ("s", (3,), "needs a str"),
        ("o", ("no/slash",), "object path"),
        ("v", (3,), "Variant"),
        ("(yy)", ((1,),), "struct of 2"),
        ("yy", (1,), "2 types, 1 values"),
    ],
)
def test_unmarshallable_values_are_refused(signature: str, values: tuple, match: str) -> None:
    with pytest.raises(DBusWireError, match=match):
        wire.marshal(signature, values)
