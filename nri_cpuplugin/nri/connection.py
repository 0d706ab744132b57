"""The NRI socket as a sans-I/O state machine (in the manner of h11).

``receive_data(bytes)`` turns whatever the socket delivered into events: requests the runtime
made of us (conn 1) and responses to our own requests (conn 2).  ``send_request`` and
``send_response`` turn calls into the exact bytes to write.  No sockets, no asyncio: the
asyncio stub (stub.py) owns the I/O, and tests drive this class with plain bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from . import mux, ttrpc
from .errors import ProtocolError
from .pb import ttrpc_pb2

# gRPC status codes used on the wire.
OK = 0
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13


@dataclass(frozen=True)
class RequestReceived:
    """The peer called one of the methods we serve; answer with send_response."""

    stream_id: int
    service: str
    method: str
    payload: bytes
    timeout_ns: int  # remaining deadline the runtime announced; 0 = none (may be negative)


@dataclass(frozen=True)
class BadRequest:
    """A request we cannot even read (oversized or a broken envelope): answer it with an error
    status rather than dropping the connection, as Go ttrpc does."""

    stream_id: int
    code: int
    message: str


@dataclass(frozen=True)
class ResponseReceived:
    """The peer answered one of our requests."""

    stream_id: int
    code: int
    message: str
    payload: bytes


Event = RequestReceived | BadRequest | ResponseReceived


class Connection:
    """Both logical connections of one NRI socket.

    By default from the plugin's side: we serve conn 1 and call on conn 2.  ``runtime=True``
    mirrors the roles, which tests use to play the runtime with the very same codec.
    """

    def __init__(self, max_message: int = ttrpc.MAX_MESSAGE, runtime: bool = False) -> None:
        self._mux = mux.MuxDecoder()
        self._serve_conn, self._call_conn = (
            (mux.RUNTIME_CONN, mux.PLUGIN_CONN) if runtime else (mux.PLUGIN_CONN, mux.RUNTIME_CONN)
        )
        self._streams = {
            mux.PLUGIN_CONN: ttrpc.TtrpcDecoder(max_message),
            mux.RUNTIME_CONN: ttrpc.TtrpcDecoder(max_message),
        }
        self._next_stream_id = 1  # our client side: odd ids, counting up

    # --- input ---------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received and held, not yet a whole frame or message: what a peer that stops
        mid-message costs us, bounded by what a frame and a message may declare."""
        return self._mux.buffered + sum(d.buffered for d in self._streams.values())

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes read from the socket; raise ProtocolError if the stream is broken."""
        events: list[Event] = []
        for conn_id, chunk in self._mux.feed(data):
            decoder = self._streams.get(conn_id)
            if decoder is None:
                continue  # like the Go mux: frames for connections nobody opened are dropped
            for item in decoder.feed(chunk):
                event = self._to_event(conn_id, item)
                if event is not None:
                    events.append(event)
        return events

    def _to_event(self, conn_id: int, item: ttrpc.Message | ttrpc.Oversized) -> Event | None:
        if conn_id == self._serve_conn:
            if item.type != ttrpc.TYPE_REQUEST:
                return None  # streaming frames: not part of NRI; Go servers ignore them too
            if isinstance(item, ttrpc.Oversized):
                return BadRequest(
                    item.stream_id,
                    RESOURCE_EXHAUSTED,
                    f"message length {item.length} exceeded maximum message size "
                    f"{ttrpc.MAX_MESSAGE}",
                )
            request = ttrpc_pb2.Request()
            try:
                request.ParseFromString(item.body)
            except DecodeError as err:
                return BadRequest(item.stream_id, INVALID_ARGUMENT, f"malformed request: {err}")
            return RequestReceived(
                item.stream_id,
                request.service,
                request.method,
                request.payload,
                request.timeout_nano,
            )
        if item.type != ttrpc.TYPE_RESPONSE:
            return None
        if isinstance(item, ttrpc.Oversized):
            return ResponseReceived(
                item.stream_id, RESOURCE_EXHAUSTED, f"response of {item.length} bytes dropped", b""
            )
        response = ttrpc_pb2.Response()
        try:
            response.ParseFromString(item.body)
        except DecodeError as err:
            return ResponseReceived(item.stream_id, INTERNAL, f"malformed response: {err}", b"")
        return ResponseReceived(
            item.stream_id, response.status.code, response.status.message, response.payload
        )

    # --- output --------------------------------------------------------------------------

    def send_request(
        self, service: str, method: str, payload: bytes, timeout_ns: int = 0
    ) -> tuple[int, bytes]:
        """Bytes for a call to the peer and the stream id its answer will carry."""
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        body = ttrpc_pb2.Request(
            service=service, method=method, payload=payload, timeout_nano=timeout_ns
        ).SerializeToString()
        return stream_id, _frames(self._call_conn, stream_id, ttrpc.TYPE_REQUEST, body)

    def send_response(
        self, stream_id: int, payload: bytes = b"", code: int = OK, message: str = ""
    ) -> bytes:
        """Bytes answering the peer's request ``stream_id``.

        Success carries no status at all, as Go ttrpc servers send it; an error carries the
        status and no payload.
        """
        response = ttrpc_pb2.Response()
        if code == OK:
            response.payload = payload
        else:
            response.status.code = code
            response.status.message = message
        body = response.SerializeToString()
        return _frames(self._serve_conn, stream_id, ttrpc.TYPE_RESPONSE, body)


def _frames(conn_id: int, stream_id: int, msg_type: int, body: bytes) -> bytes:
    """One message as mux frames that the Go reader accepts (docs/nri-wire.md §2.3).

    The Go side reads a message header into a 4096-byte buffer and drops the connection if
    the frame holding it is larger.  So a message that fits in 4096 bytes travels as one frame;
    a larger one as a frame with just the 10-byte header and a frame with the body, which the
    Go side then reads straight into a buffer of the body's size.  A frame never holds parts of
    two messages.
    """
    header = ttrpc.encode_header(stream_id, msg_type, len(body))
    if len(header) + len(body) <= mux.GO_READ_BUFFER:
        return mux.encode_frame(conn_id, header + body)
    return mux.encode_frame(conn_id, header) + mux.encode_frame(conn_id, body)


__all__ = [
    "INTERNAL",
    "INVALID_ARGUMENT",
    "OK",
    "RESOURCE_EXHAUSTED",
    "UNIMPLEMENTED",
    "UNKNOWN",
    "BadRequest",
    "Connection",
    "Event",
    "ProtocolError",
    "RequestReceived",
    "ResponseReceived",
]
