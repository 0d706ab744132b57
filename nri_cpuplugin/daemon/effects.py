"""What the node's handling of one event asks the runtime to do: the reply.

Direct cgroup writes are not here: the node hands them to its writer (daemon/writer.py) before
the reply leaves, and what the writer cannot write comes back as reply updates or owed ones.
"""

from __future__ import annotations

from collections.abc import Callable

from ..base.value import Value
from ..core.outcome import Target
from .events import Owe, Release, Restore


class Effects(Value):
    """``own``: the request's own container (a creation's adjustment, an update's last entry);
    ``updates``: other containers' targets for the runtime to apply, resolved for it (memory
    nodes read where a target asks for its parent's); ``undo``: the event that takes this
    one's decision back when its request was answered with an error after all."""

    own: Target | None = None
    updates: tuple[Target, ...] = ()
    undo: Release | Restore | None = None

    def owed_when_unsent(self, own_too: bool) -> Owe:
        """What the runtime must still hear when this reply never reaches it."""
        ids = [t.container_id for t in self.updates]
        if own_too and self.own is not None:
            ids.append(self.own.container_id)
        return Owe(tuple(ids))


NO_EFFECTS = Effects()

# Hands a reply to the runtime before the rest of an event's work is done; False when the
# request was answered with an error meanwhile (nothing more may be decided for it).
Deliver = Callable[[Effects], bool]


def keep(effects: Effects) -> bool:
    """Deliver outside the worker: the reply goes when the handler returns."""
    return True
