"""JSON to and from UTF-8 bytes, through orjson or the standard library: the same bytes either way.

The daemon encodes and verifies the state document on every decision, where orjson is ~10x
faster than ``json``.  The OCI hook is a new process per container start: importing orjson
costs it ~25 ms (orjson loads datetime, uuid, dataclasses and json itself), more than all of its
work, so the hook calls ``use_stdlib()`` first (for the whole process).  For what we write -
objects with string keys, lists, strings, 64-bit integers, booleans and null; never floats,
whose text differs - both produce identical bytes, sorted or not, compact or indented
(tests/unit/test_jsonbytes.py checks this with generated documents), so a checksum one process
wrote verifies in the other.  Reading, the standard library is held to orjson's rules: UTF-8
only, no NaN or infinite numbers, no lone surrogates, and input nested too deeply or a number
of thousands of digits is a DecodeError like any other bad input, never a RecursionError or
the ValueError of Python's integer-string limit.
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
    """The value of the JSON document ``data``; DecodeError, and nothing else, for bad input."""
    if not _stdlib:
        import orjson  # after the first call, a dictionary lookup

        try:
            return orjson.loads(data)
        except DecodeError:
            raise
        except ValueError as err:  # (none known; the contract is DecodeError for any input)
            raise DecodeError(str(err), "", 0) from None
    if not isinstance(data, str):
        try:
            data = bytes(data).decode()
        except UnicodeDecodeError as err:
            raise DecodeError(f"not UTF-8 ({err.reason})", "", err.start) from None
    try:
        value = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except DecodeError:
        raise
    except RecursionError:
        raise DecodeError("nested too deeply", "", 0) from None
    except ValueError:
        # int() refuses more than 4300 digits (sys.int_info.default_max_str_digits), a guard
        # against quadratic conversion time; orjson refuses such a number too.
        raise DecodeError("a number with too many digits", "", 0) from None
    # Decoded UTF-8 holds no surrogates; only a \uD8xx-\uDFxx escape can make one, and
    # json pairs those it can.  The rare document with such escapes is checked for a lone one.
    if "\\ud" in data or "\\uD" in data:
        _refuse_lone_surrogates(value)
    return value


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


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise DecodeError(f"number {text} is infinite as a double", text, 0)
    return value


def _refuse_lone_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                raise DecodeError("a lone surrogate escape (not UTF-8 text)", "", 0) from None
