"""Errors of the core's decisions."""

from __future__ import annotations

from ..base.errors import PluginError


class PolicyError(PluginError):
    """A request that cannot be met; the message is shown to whoever created the container.

    Codes: ``refused`` (no room, a request the policy cannot honour, or a configuration it
    cannot run with) and ``bad-annotation`` (a value the pod author must fix)."""

    code = "refused"
