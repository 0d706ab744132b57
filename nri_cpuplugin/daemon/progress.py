"""What the job now running is waiting for, and whether it may go on.

The node reports its phase at every wait that can outlast a request's budget (the state lock,
the durable commit, netlink, the cgroup writes that precede an answer), so a missed deadline
names its cause; and it asks, at the points after which a decision would stand, whether its
request was answered with an error meanwhile (then it stops: the runtime is not creating that
container after all).  The daemon's worker (daemon/worker.py) tracks both per job; anything run
outside it has no deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class Progress(Protocol):
    def phase(self, phase: str) -> contextlib.AbstractContextManager[None]: ...

    def check(self) -> None:
        """Raise Abandoned when the running request was answered with an error."""


QUEUED = "queued"  # behind another job (a miss is reported with that job's phase)
DECIDING = "deciding"
STATE_LOCK = "state-lock"
COMMIT = "commit"
NIC = "nic"
CGROUPS = "cgroup-writes"  # the shared containers' cgroups, before a creation's answer


class Abandoned(Exception):
    """Raised instead of going on with a job whose request was answered with an error already:
    the runtime is not creating (or resizing) that container after all."""


class NoProgress:
    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        yield

    def check(self) -> None:
        pass
