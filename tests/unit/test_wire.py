"""Sans-I/O codecs: mux frames, ttrpc messages, the NRI connection - bytes only, no sockets."""

from __future__ import annotations

import struct
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nri_cpuplugin.nri import connection as wire
from nri_cpuplugin.nri import mux, ttrpc
from nri_cpuplugin.nri.errors import ProtocolError
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.nri.pb import ttrpc_pb2


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in pairwise(points)]


def frames_of(data: bytes) -> list[tuple[int, bytes]]:
    decoder = mux.MuxDecoder()
    frames = decoder.feed(data)
    assert decoder.buffered == 0
    return frames


# --- mux ----------------------------------------------------------------------------------


def test_mux_frame_layout():
    assert mux.encode_frame(2, b"abc") == b"\x00\x00\x00\x02\x00\x00\x00\x03abc"


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.sampled_from([1, 2, 7]), st.binary(max_size=300)), max_size=8),
    st.lists(st.integers(min_value=0), max_size=20),
)
def test_mux_reassembles_any_split(frames, cuts):
    stream = b"".join(mux.encode_frame(c, p) for c, p in frames)
    decoder = mux.MuxDecoder()
    got = []
    for piece in split(stream, cuts):
        got += decoder.feed(piece)
    assert got == frames and decoder.buffered == 0


def test_mux_refuses_absurd_length_before_buffering():
    decoder = mux.MuxDecoder()
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(struct.pack(">II", 1, 0xFFFFFFFF))
    with pytest.raises(ProtocolError, match="reserved conn id 0"):
        mux.MuxDecoder().feed(struct.pack(">II", 0, 1) + b"x")


def test_mux_accepts_frames_far_larger_than_4096():
    payload = bytes(range(256)) * 20_000  # 5 MB, as ttrpc <= 1.2.5 peers may send
    assert mux.MuxDecoder().feed(mux.encode_frame(1, payload)) == [(1, payload)]


# --- ttrpc ----------------------------------------------------------------------------------


def test_ttrpc_header_layout():
    assert ttrpc.encode_header(1, ttrpc.TYPE_REQUEST, 60) == bytes.fromhex("0000003c000000010100")


@settings(max_examples=200)
@given(st.lists(st.binary(max_size=200), max_size=6), st.lists(st.integers(0), max_size=20))
def test_ttrpc_reassembles_any_split(bodies, cuts):
    stream = b"".join(
        ttrpc.encode_header(2 * i + 1, ttrpc.TYPE_RESPONSE, len(b)) + b
        for i, b in enumerate(bodies)
    )
    decoder = ttrpc.TtrpcDecoder()
    got = []
    for piece in split(stream, cuts):
        got += decoder.feed(piece)
    assert [(m.stream_id, m.body) for m in got] == [(2 * i + 1, b) for i, b in enumerate(bodies)]


def test_ttrpc_oversized_body_is_skipped_not_buffered():
    decoder = ttrpc.TtrpcDecoder(max_message=100)
    big = struct.pack(">IIBB", 5000, 3, 1, 0)
    events = decoder.feed(big + b"x" * 1000)
    assert events == [ttrpc.Oversized(3, 1, 5000)]
    assert decoder.buffered == 0  # nothing of the body is kept
    events = decoder.feed(b"y" * 4000 + ttrpc.encode_header(5, 1, 2) + b"ok")
    assert events == [ttrpc.Message(5, 1, 0, b"ok")]


def test_refuses_to_send_oversized_message():
    with pytest.raises(ProtocolError, match="refusing to send"):
        ttrpc.encode_header(1, 1, ttrpc.MAX_MESSAGE + 1)


# --- connection ----------------------------------------------------------------------------


def test_register_plugin_bytes_match_the_protocol_example():
    payload = pb.RegisterPluginRequest(plugin_name="cpupin", plugin_idx="50").SerializeToString()
    stream_id, data = wire.Connection().send_request(
        "nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin", payload
    )
    expected = (
        bytes.fromhex("00000002000000460000003c000000010100")
        + b"\x0a\x1cnri.pkg.api.v1alpha1.Runtime"
        + b"\x12\x0eRegisterPlugin"
        + b"\x1a\x0c\x0a\x06cpupin\x12\x0250"
    )
    assert stream_id == 1 and data == expected


def test_client_stream_ids_are_odd_and_increasing():
    conn = wire.Connection()
    ids = [conn.send_request("s", "m", b"")[0] for _ in range(4)]
    assert ids == [1, 3, 5, 7]


@pytest.mark.parametrize("size", [0, 100, 4086, 4087, 200_000, 3_000_000])
def test_frames_never_put_a_header_in_a_frame_over_4096(size):
    data = wire.Connection().send_response(7, b"p" * size)
    frames = frames_of(data)
    assert frames[0][0] == mux.PLUGIN_CONN
    body = ttrpc_pb2.Response(payload=b"p" * size).SerializeToString()
    if ttrpc.HEADER.size + len(body) <= 4096:
        assert len(frames) == 1
    else:
        assert [len(p) for _, p in frames] == [ttrpc.HEADER.size, len(body)]
    assert b"".join(p for _, p in frames) == ttrpc.encode_header(7, 2, len(body)) + body


def test_success_response_has_no_status_and_error_has_no_payload():
    ok = frames_of(wire.Connection().send_response(1, b"xy"))
    assert ok[0][1][ttrpc.HEADER.size :] == b"\x12\x02xy"
    err = wire.Connection().send_response(1, b"ignored", wire.UNIMPLEMENTED, "method Foo")
    response = ttrpc_pb2.Response.FromString(frames_of(err)[0][1][ttrpc.HEADER.size :])
    assert (response.status.code, response.status.message, response.payload) == (
        12,
        "method Foo",
        b"",
    )


def test_runtime_and_plugin_sides_understand_each_other():
    plugin, runtime = wire.Connection(), wire.Connection(runtime=True)
    stream_id, data = runtime.send_request(
        "nri.pkg.api.v1alpha1.Plugin", "Configure", b"cfg", timeout_ns=-5
    )
    [request] = plugin.receive_data(data)
    assert request == wire.RequestReceived(
        stream_id, "nri.pkg.api.v1alpha1.Plugin", "Configure", b"cfg", -5
    )
    [response] = runtime.receive_data(plugin.send_response(stream_id, b"\x10\x08"))
    assert response == wire.ResponseReceived(stream_id, 0, "", b"\x10\x08")


def test_broken_envelope_becomes_a_bad_request_not_a_dead_connection():
    runtime_bytes = mux.encode_frame(1, ttrpc.encode_header(3, 1, 3) + b"\xff\xff\xff")
    [event] = wire.Connection().receive_data(runtime_bytes)
    assert isinstance(event, wire.BadRequest) and event.code == wire.INVALID_ARGUMENT


def test_oversized_request_is_answered_resource_exhausted():
    conn = wire.Connection(max_message=64)
    head = mux.encode_frame(1, ttrpc.encode_header(9, 1, 100))
    [event] = conn.receive_data(head + mux.encode_frame(1, b"z" * 100))
    assert event.stream_id == 9 and event.code == wire.RESOURCE_EXHAUSTED


def test_frames_for_unknown_connections_are_ignored():
    assert wire.Connection().receive_data(mux.encode_frame(5, b"whatever")) == []


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000), st.lists(st.integers(0), max_size=10))
def test_arbitrary_bytes_raise_only_protocol_errors(data, cuts):
    conn = wire.Connection()
    try:
        for piece in split(data, cuts):
            conn.receive_data(piece)
    except ProtocolError:
        return
    # Whatever is pending is bounded by what a frame may declare, never more than was fed.
    assert conn.buffered <= len(data)


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(max_size=64)), max_size=6),
    st.lists(st.integers(0), max_size=10),
    st.integers(0, 200),
)
def test_truncated_valid_streams_never_hang_or_lie(messages, cuts, chop):
    runtime = wire.Connection(runtime=True)
    stream = b"".join(runtime.send_request("svc", "m", body)[1] for _, body in messages)
    stream = stream[: max(0, len(stream) - chop)]
    plugin = wire.Connection()
    events = []
    for piece in split(stream, cuts):
        events += plugin.receive_data(piece)
    # Only complete messages come out, in order, intact.
    assert [e.payload for e in events] == [body for _, body in messages][: len(events)]
