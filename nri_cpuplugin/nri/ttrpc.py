"""ttrpc message framing, sans I/O: a byte stream in, whole messages out; messages to bytes.

A message is a 10-byte big-endian header ``[length u32][stream id u32][type u8][flags u8]``
followed by ``length`` bytes of protobuf envelope (ttrpc.Request or ttrpc.Response).  NRI only
makes unary calls: requests carry type 1, responses type 2, flags 0; clients use odd stream
ids counting up from 1, and a response reuses its request's id (docs/nri-wire.md §3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import ProtocolError

HEADER = struct.Struct(">IIBB")
TYPE_REQUEST = 1
TYPE_RESPONSE = 2  # (3, data, belongs to ttrpc streaming, which NRI never uses)

# ttrpc's message limit.  A bigger body is not buffered: it is skipped and reported, so the
# server can answer RESOURCE_EXHAUSTED for that stream as Go ttrpc does, and the connection
# survives (ttrpc <= 1.2.5 peers do send such messages).
MAX_MESSAGE = 4 * 1024 * 1024


@dataclass(frozen=True)
class Message:
    stream_id: int
    type: int
    flags: int
    body: bytes


@dataclass(frozen=True)
class Oversized:
    """A message whose body exceeded the limit; its bytes were discarded."""

    stream_id: int
    type: int
    length: int


def encode_header(stream_id: int, msg_type: int, length: int, flags: int = 0) -> bytes:
    if length > MAX_MESSAGE:
        raise ProtocolError(f"refusing to send a {length}-byte ttrpc message (limit {MAX_MESSAGE})")
    return HEADER.pack(length, stream_id, msg_type, flags)


class TtrpcDecoder:
    """Reassembles messages from one logical connection's chunks, whatever their split."""

    def __init__(self, max_message: int = MAX_MESSAGE) -> None:
        self.max_message = max_message
        self._buffer = bytearray()
        self._skipping = 0  # bytes of an oversized body still to discard

    @property
    def buffered(self) -> int:
        """Bytes held that are not a whole message yet (an oversized body is not held)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message | Oversized]:
        events: list[Message | Oversized] = []
        view = memoryview(data)
        if self._skipping:
            dropped = min(self._skipping, len(view))
            self._skipping -= dropped
            view = view[dropped:]
        self._buffer += view
        buffer = self._buffer
        offset = 0
        while len(buffer) - offset >= HEADER.size:
            length, stream_id, msg_type, flags = HEADER.unpack_from(buffer, offset)
            body_start = offset + HEADER.size
            if length > self.max_message:
                events.append(Oversized(stream_id, msg_type, length))
                available = len(buffer) - body_start
                dropped = min(available, length)
                self._skipping = length - dropped
                offset = body_start + dropped
                continue
            end = body_start + length
            if end > len(buffer):
                break
            events.append(Message(stream_id, msg_type, flags, bytes(buffer[body_start:end])))
            offset = end
        if offset:
            del buffer[:offset]
        return events
