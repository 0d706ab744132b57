"""How a hook run ends when it cannot do its job: its exit codes, and the exception that
carries a one-line reason to stderr and the audit trail (hook/entry.py)."""

from __future__ import annotations

EXIT_OK, EXIT_REFUSED, EXIT_INPUT = 0, 1, 2


class HookFailure(Exception):
    """Ends the run with a one-line reason on stderr and a non-zero exit."""

    def __init__(
        self,
        message: str,
        code: int = EXIT_REFUSED,
        action: str = "hook-failed",
        **fields: object,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.action = action
        self.fields = fields
