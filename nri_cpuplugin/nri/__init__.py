"""NRI transport: the connection multiplexer, ttrpc framing and generated protobuf messages."""
