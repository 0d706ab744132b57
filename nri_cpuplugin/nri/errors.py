"""The one exception type the wire codecs raise."""

from ..base.errors import PluginError


class ProtocolError(PluginError):
    """The peer sent bytes that break the NRI mux or ttrpc framing; the connection is unusable."""

    code = "protocol"
