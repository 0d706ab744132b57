"""Checking the shape of decoded JSON: one set of small checks for every document we read
(state, hook records, OCI state and config, the topology cache).

Each returns the value when it has the expected type and raises ``ShapeError`` (a ValueError)
naming the field otherwise: decoded JSON is untrusted until these pass.
"""

from __future__ import annotations

from .errors import PluginError

TYPE_CHECKING = False  # typing is not imported at run time (the OCI hook's start-up cost)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


class ShapeError(PluginError, ValueError):
    code = "shape"


def obj(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ShapeError(f"{what} is not a JSON object")
    return value


def _get(doc: Mapping[str, Any], key: str, optional: bool) -> Any:
    if key not in doc or (optional and doc[key] is None):
        if optional:
            return None
        raise ShapeError(f"{key} is missing")
    return doc[key]


def string(doc: Mapping[str, Any], key: str, optional: bool = False) -> Any:
    value = _get(doc, key, optional)
    if value is not None and not isinstance(value, str):
        raise ShapeError(f"{key} must be a string, found {type(value).__name__}")
    return value


def integer(
    doc: Mapping[str, Any], key: str, optional: bool = False, minimum: int | None = None
) -> Any:
    value = _get(doc, key, optional)
    if value is None:
        return None
    # bool is an int to Python, never to JSON's writers.
    if type(value) is not int or (minimum is not None and value < minimum):
        raise ShapeError(f"{key} must be an integer{_at_least(minimum)}, found {_show(value)}")
    return value


def boolean(doc: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise ShapeError(f"{key} must be a boolean")
    return value


def array(doc: Mapping[str, Any], key: str) -> list:
    value = _get(doc, key, False)
    if not isinstance(value, list):
        raise ShapeError(f"{key} must be a list")
    return value


def mapping(doc: Mapping[str, Any], key: str) -> dict:
    value = _get(doc, key, False)
    if not isinstance(value, dict):
        raise ShapeError(f"{key} must be an object")
    return value


def strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ShapeError(f"{what} must be a list of strings")
    return value


def string_map(doc: Mapping[str, Any], key: str, what: str = "") -> dict[str, str]:
    """An optional object of strings to strings (annotations, paths by id)."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ShapeError(f"{what or key} is not a map of strings to strings")
    return value


def _at_least(minimum: int | None) -> str:
    return "" if minimum is None else f" >= {minimum}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
