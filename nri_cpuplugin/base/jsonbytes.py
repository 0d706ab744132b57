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

The standard library path calls json's C accelerator (``_json``) directly, as ``json`` itself
does, and imports ``json`` only when that cannot give the answer: an error to report (json's
own message), a type it does not write, or an interpreter without ``_json``.  Importing json
would cost the hook a few milliseconds of start-up, for regular expressions its pure-Python
fallbacks use (it imports re, and through it enum and functools); its indented output comes
from pure Python anyway, which ``_indented`` reproduces for the types we write.
tests/unit/test_jsonbytes.py holds every path to json's output and errors.
"""

from __future__ import annotations

try:
    import _json  # CPython's accelerator: what json uses when it is there
except ImportError:  # pragma: no cover - other interpreters: json alone
    _json = None  # type: ignore[assignment]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from json import JSONDecodeError as DecodeError
    from typing import Any

__all__ = ["DecodeError", "dumps", "loads", "use_stdlib"]

_stdlib = False

# What json.loads skips around the document (its WHITESPACE pattern).
_WHITESPACE = " \t\n\r"


def __getattr__(name: str) -> Any:
    # ``DecodeError``: what both decoders raise for bad input (orjson.JSONDecodeError is a
    # subclass of it): json.JSONDecodeError, looked up when first asked for (an ``except``
    # clause evaluates it only when an exception passes), so a run without errors never
    # imports json.
    if name == "DecodeError":
        from json import JSONDecodeError

        return JSONDecodeError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_stdlib() -> None:
    """Use the standard library from now on, for a process that must start fast."""
    global _stdlib
    _stdlib = True


def loads(data: bytes | str) -> Any:
    """The value of the JSON document ``data``; DecodeError, and nothing else, for bad input."""
    if not _stdlib:
        import json

        import orjson  # after the first call, a dictionary lookup

        try:
            return orjson.loads(data)
        except json.JSONDecodeError:
            raise
        except ValueError as err:  # (none known; the contract is DecodeError for any input)
            raise json.JSONDecodeError(str(err), "", 0) from None
    if not isinstance(data, str):
        try:
            data = bytes(data).decode()
        except UnicodeDecodeError as err:
            raise _error(f"not UTF-8 ({err.reason})", "", err.start) from None
    value, done = _scan(data)
    if not done:
        value = _json_loads(data)
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
    text = None
    if _json is not None:
        try:
            if indent:
                parts: list[str] = []
                _indented(value, parts, 0, sort_keys, set())
                text = "".join(parts)
            else:
                text = "".join(_compact_encoder(sort_keys)(value, 0))
        except Exception:  # json.dumps below says what is wrong, in its own words
            text = None
    if text is None:
        import json

        text = json.dumps(
            value,
            ensure_ascii=False,
            allow_nan=False,
            sort_keys=sort_keys,
            indent=2 if indent else None,
            separators=(",", ": ") if indent else (",", ":"),
        )
    return text.encode()


# --- reading --------------------------------------------------------------------------------


def _scan(text: str) -> tuple[Any, bool]:
    """(value, True) when json's C scanner reads ``text`` as one document, as json.loads
    would; (None, False) for anything else - bad input included, which ``_json_loads`` then
    reports as json does (the scanner needs json.decoder loaded to raise its errors)."""
    if _scanner is None:
        return None, False
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = _scanner(text, start)
    except Exception:
        return None, False
    # json.loads refuses anything after the document but whitespace.  (A byte order mark
    # stops the scanner at the start, as json.loads refuses it.)
    return (value, True) if end == len(text.rstrip(_WHITESPACE)) else (None, False)


def _json_loads(text: str) -> Any:
    import json

    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except ValueError:
        # int() refuses more than 4300 digits (sys.int_info.default_max_str_digits), a guard
        # against quadratic conversion time; orjson refuses such a number too.
        raise json.JSONDecodeError("a number with too many digits", "", 0) from None


def _error(message: str, doc: str, pos: int) -> Exception:
    from json import JSONDecodeError

    return JSONDecodeError(message, doc, pos)


def _refuse_constant(name: str) -> Any:
    raise _error(f"{name} is not JSON", name, 0)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _error(f"number {text} is infinite as a double", text, 0)
    return value


class _Settings:
    """What ``_json.make_scanner`` reads from a json.JSONDecoder: the settings ``_json_loads``
    passes to json.loads."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_int = int
    parse_float = staticmethod(_finite_float)
    parse_constant = staticmethod(_refuse_constant)


# (typeshed types make_scanner's argument as a JSONDecoder: _Settings carries what it reads.)
_scanner: Callable[[str, int], tuple[Any, int]] | None = (
    _json.make_scanner(_Settings())  # type: ignore[arg-type]
    if _json is not None  # type: ignore[redundant-expr]
    else None
)


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
                raise _error("a lone surrogate escape (not UTF-8 text)", "", 0) from None


# --- writing --------------------------------------------------------------------------------


class _Unsupported(Exception):
    """A value ``_indented`` leaves to json (it never writes floats, nor other types)."""


def _refuse(value: Any) -> Any:
    raise _Unsupported(type(value).__name__)


def _compact_encoder(sort_keys: bool) -> Any:
    """json.dumps(ensure_ascii=False, allow_nan=False, separators=(",", ":")) makes exactly
    this encoder (json.encoder.JSONEncoder.iterencode); other types are left to json."""
    return _json.make_encoder(
        {}, _refuse, _json.encode_basestring, None, ":", ",", sort_keys, False, False
    )


def _indented(value: Any, parts: list[str], depth: int, sort_keys: bool, open_: set[int]) -> None:
    """``value`` as json.dumps(indent=2, separators=(",", ": "), ensure_ascii=False) writes it
    (json.encoder._make_iterencode) for the types we write: str, int, bool, None, and lists,
    tuples and str-keyed dicts of them; _Unsupported for anything else, ValueError for a
    container inside itself."""
    kind = type(value)
    if kind is str:
        parts.append(_json.encode_basestring(value))
    elif kind is int:
        parts.append(int.__repr__(value))
    elif value is None or kind is bool:
        parts.append(_CONSTANTS[value])
    elif kind is list or kind is tuple or kind is dict:
        if not value:
            parts.append("{}" if kind is dict else "[]")
            return
        if id(value) in open_:
            raise ValueError("Circular reference detected")
        open_.add(id(value))
        if kind is dict:
            _indented_object(value, parts, depth, sort_keys, open_)
        else:
            _indented_array(value, parts, depth, sort_keys, open_)
        open_.discard(id(value))
    else:
        raise _Unsupported(kind.__name__)


_CONSTANTS = {None: "null", True: "true", False: "false"}


def _indented_object(
    value: dict, parts: list[str], depth: int, sort_keys: bool, open_: set[int]
) -> None:
    inner = "\n" + "  " * (depth + 1)
    parts.append("{")
    items = sorted(value.items()) if sort_keys else value.items()
    for i, (key, item) in enumerate(items):
        if type(key) is not str:
            raise _Unsupported(type(key).__name__)
        parts.append("," + inner if i else inner)
        parts.append(_json.encode_basestring(key))
        parts.append(": ")
        _indented(item, parts, depth + 1, sort_keys, open_)
    parts.append("\n" + "  " * depth + "}")


def _indented_array(
    value: list | tuple, parts: list[str], depth: int, sort_keys: bool, open_: set[int]
) -> None:
    inner = "\n" + "  " * (depth + 1)
    parts.append("[")
    for i, item in enumerate(value):
        parts.append("," + inner if i else inner)
        _indented(item, parts, depth + 1, sort_keys, open_)
    parts.append("\n" + "  " * depth + "]")
