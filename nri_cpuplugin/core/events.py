"""Audit events as values: what the engine says happened, before anyone writes it anywhere.

The engine returns these with every outcome; ``ops/audit.py`` turns them into journald records.
Priorities are syslog's.
"""

from __future__ import annotations

from types import MappingProxyType

from ..base.value import Value

TYPE_CHECKING = False  # collections.abc is not imported at run time (the OCI hook's start-up)
if TYPE_CHECKING:
    from collections.abc import Mapping

ERR, WARNING, NOTICE, INFO, DEBUG = 3, 4, 5, 6, 7

_NONE: Mapping = MappingProxyType({})


class AuditEvent(Value):
    action: str  # ACTION= of the record (docs/operator-guide.md lists them)
    message: str
    priority: int = INFO
    fields: Mapping[str, object] = _NONE


def event(action: str, message: str, priority: int = INFO, /, **fields: object) -> AuditEvent:
    """An audit event; ``fields`` become its record's fields (positional-only parameters, so a
    field may have any name)."""
    return AuditEvent(action, message, priority, MappingProxyType(fields))
