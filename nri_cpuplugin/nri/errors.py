"""The one exception type the wire codecs raise."""


class ProtocolError(Exception):
    """The peer sent bytes that break the NRI mux or ttrpc framing; the connection is unusable."""
