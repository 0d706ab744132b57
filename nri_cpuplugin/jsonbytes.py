"""JSON to and from UTF-8 bytes, through orjson or the standard library: the same bytes either way.

The daemon encodes and verifies the state document on every decision, where orjson is ~10x
faster than ``json``.  The OCI hook is a new process per container start: importing orjson
costs it ~25 ms (orjson loads datetime, uuid, dataclasses and json itself), more than all of its
work, so the hook calls ``use_stdlib()`` first.  For what we write - objects, lists, strings,
integers and booleans - both produce identical bytes, sorted or not, compact or indented
(tests/test_jsonbytes.py checks this with generated documents), so a checksum one process
wrote verifies in the other.  Reading, the standard library is held to orjson's rules: UTF-8
only, no NaN or Infinity.
"""

from __future__ import annotations

import json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# What both decoders raise for bad input (orjson.JSONDecodeError is a subclass of it).
DecodeError = json.JSONDecodeError

_stdlib = False


def use_stdlib() -> None:
    """Use the standard library from now on, for a process that must start fast."""
    global _stdlib
    _stdlib = True


def loads(data: bytes | str) -> Any:
    if not _stdlib:
        import orjson  # after the first call, a dictionary lookup

        return orjson.loads(data)
    if not isinstance(data, str):
        try:
            data = bytes(data).decode()
        except UnicodeDecodeError as err:
            raise DecodeError(f"not UTF-8 ({err.reason})", "", err.start) from None
    return json.loads(data, parse_constant=_refuse_constant)


def dumps(value: Any, *, sort_keys: bool = False, indent: bool = False) -> bytes:
    """Compact JSON, or indented by two spaces; object keys sorted when ``sort_keys``."""
    if not _stdlib:
        import orjson

        option = (orjson.OPT_SORT_KEYS if sort_keys else 0) | (orjson.OPT_INDENT_2 if indent else 0)
        return orjson.dumps(value, option=option)
    text = json.dumps(
        value,
        ensure_ascii=False,
        allow_nan=False,
        sort_keys=sort_keys,
        indent=2 if indent else None,
        separators=(",", ": ") if indent else (",", ":"),
    )
    return text.encode()


def _refuse_constant(name: str) -> Any:
    raise DecodeError(f"{name} is not JSON", name, 0)
