"""Work the node does on its own, which no request may wait behind (daemon/worker.py runs it).

Background work is a *step* function, called again while it returns True (more to do).  The
worker calls a step only when no request is queued, and a step stops early once one is
(``waiting``): a request waits at most for the one write, read or commit a step is in.
Steps are bounded (a few interrupt writes, one sweep round), so upkeep that takes a minute
on a large node - narrowing thousands of interrupts - is spread between the requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# A step of background work: True while more is left.
Step = Callable[[], bool]


class Background(Protocol):
    def upkeep(self, name: str, step: Step) -> object:
        """Run ``step`` until it returns False, between the runtime's requests."""

    def waiting(self) -> bool:
        """Whether a request is queued: a step stops as soon as it can."""


class Inline:
    """Background work done at once, to its end (a node without the daemon's worker)."""

    def upkeep(self, name: str, step: Step) -> None:
        while step():
            pass

    def waiting(self) -> bool:
        return False
