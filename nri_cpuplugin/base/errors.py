"""The one error base: a message for people and a reason code for programs.

Callers branch on ``code`` (a short stable string), never on the message text, which is free to
improve.  Every error the product raises on purpose derives from ``PluginError``.
"""

from __future__ import annotations


class PluginError(Exception):
    """An error with a stable reason ``code`` (subclasses set a default)."""

    code = "error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class suppress:  # (lower case: it stands in for contextlib.suppress)
    """``with suppress(OSError): ...`` - contextlib.suppress for the modules the OCI hook
    loads: importing contextlib also loads collections and functools, a measurable part of the
    hook's start-up (tests/system/test_hook_imports.py)."""

    __slots__ = ("exceptions",)

    def __init__(self, *exceptions: type[BaseException]) -> None:
        self.exceptions = exceptions

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, self.exceptions)
