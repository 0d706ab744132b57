"""Generated protobuf messages for NRI and ttrpc.  Do not edit the ``*_pb2`` files by hand.

They are compiled from the project's own schemas in ``api/`` by ``./dev proto``
(grpcio-tools' protoc, Python classes and ``.pyi`` stubs) and committed, so importing them
needs only the ``protobuf`` runtime:

- ``nri_pb2``: package ``nri.pkg.api.v1alpha1`` - the Runtime/Plugin services' messages.
- ``ttrpc_pb2``: package ``ttrpc`` - the Request/Response envelope around every payload.
- ``ttrpc_status_pb2``: ``Status``, the error status inside a ttrpc Response (upstream gives
  it no package, so it lives in a file of its own).

tests/system/test_api_proto.py checks the schemas against upstream's and the files against a fresh
compile.
"""
