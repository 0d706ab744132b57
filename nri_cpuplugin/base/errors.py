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
