"""Containers whose target only the runtime can apply, owed to its next reply.

What changes outside an event's reply (CPU hotplug, a removal, the sweep, a request answered
before its decision) is written to the cgroups directly; what cannot be written goes with the
next reply that can carry updates (CreateContainer, UpdateContainer, StopContainer,
Synchronize) - never in an unsolicited UpdateContainers, which deadlocks containerd before
NRI 0.12.1 (docs/architecture.md, "Changes outside event replies").  This is their one
owner: containers are added, and drained by the reply that carries them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class Owed:
    def __init__(self) -> None:
        self._ids: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __contains__(self, container_id: str) -> bool:
        return container_id in self._ids

    def __iter__(self) -> Iterator[str]:
        """The owed containers, in no order, still owed (``drain`` is what hands them out)."""
        return iter(self._ids)

    def add(self, container_ids: Iterable[str]) -> None:
        self._ids.update(container_ids)

    def drain(self, carried: Iterable[str] = ()) -> list[str]:
        """Every owed container, sorted, and none owed any more: each goes out once (one that
        ended meanwhile only makes the runtime log a failure).  ``carried``: those the reply
        deals with already, or must not list (the container being created)."""
        ids, self._ids = self._ids, set()
        return sorted(ids.difference(carried))
