"""NRI's connection multiplexer, sans I/O: bytes in, (conn id, chunk) out; frames out.

Every byte on the NRI socket is inside a frame ``[conn id: u32 BE][length: u32 BE][payload]``.
Two logical connections share the socket: conn 1 carries the runtime's calls to us, conn 2 our
calls to the runtime.  A frame is a chunk of that connection's byte stream, not a message: the
ttrpc layer reassembles messages from the chunks (see ttrpc.py).  Wire facts: docs/nri-wire.md §2.

The Go side reads each frame into a 4096-byte buffer when it is between messages and fails the
whole connection if the frame does not fit, so frames we *send* follow docs/nri-wire.md §2.3
(``connection._frames``); frames we *receive* may be of any size up to ``MAX_RECEIVE_FRAME``.
"""

from __future__ import annotations

import struct

from .errors import ProtocolError

HEADER = struct.Struct(">II")
PLUGIN_CONN = 1  # runtime -> plugin calls (we serve)
RUNTIME_CONN = 2  # plugin -> runtime calls (we are the client)

# The Go reader hands over one whole frame per read into a 4096-byte bufio buffer.
GO_READ_BUFFER = 4096
# NRI <= 0.6 writes a message as one frame and refuses frames over 16 MiB; newer versions split
# at 4 MiB.  Anything larger is not NRI: refuse it before buffering a byte of it.
MAX_RECEIVE_FRAME = 16 * 1024 * 1024


def encode_frame(conn_id: int, payload: bytes) -> bytes:
    return HEADER.pack(conn_id, len(payload)) + payload


class MuxDecoder:
    """Splits the socket's byte stream into (conn id, payload) chunks.

    ``feed`` accepts any split of the stream (a frame may arrive in many reads, a read may
    hold many frames) and returns the complete frames; partial ones wait for more bytes.
    """

    def __init__(self, max_frame: int = MAX_RECEIVE_FRAME) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        frames: list[tuple[int, bytes]] = []
        offset = 0
        buffer = self._buffer
        while len(buffer) - offset >= HEADER.size:
            conn_id, length = HEADER.unpack_from(buffer, offset)
            if conn_id == 0:
                raise ProtocolError("mux frame for reserved conn id 0")
            if length > self.max_frame:
                raise ProtocolError(
                    f"mux frame of {length} bytes on conn {conn_id} exceeds the "
                    f"{self.max_frame}-byte limit"
                )
            end = offset + HEADER.size + length
            if end > len(buffer):
                break
            frames.append((conn_id, bytes(buffer[offset + HEADER.size : end])))
            offset = end
        if offset:
            del buffer[:offset]
        return frames
