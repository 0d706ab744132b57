"""The daemon's state file: its store and lock, the claim that makes an OCI hook on this node
stand aside, and when the state decided is written (docs/architecture.md, "When the state is
committed").

**The commit rule** (``commit_point``): a decision is written before its answer leaves, so a
crash can lose an answer but never a decision - except where the runtime gives every such
decision back after a crash.  Once the runtime lists its containers at each connection
(Synchronize), a creation's state is held in memory and written by the container's
StartContainer, before its first instruction, and a stop's right after its answer: a crash in
between loses nothing the runtime would not list again.  Before that, an exclusive decision
must be durable before its answer, and a shared creation is written right after its answer.
Every other event's decision is written before its answer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ..core.state import NodeState
from ..storage import owner
from ..storage.store import CommitTiming, StateStore
from .progress import COMMIT, STATE_LOCK, NoProgress, Progress

# The events the commit rule tells apart, and when their decisions are written.
CREATION, STOP = "creation", "stop"
BEFORE_ANSWER, AFTER_ANSWER, AT_START = "before-answer", "after-answer", "at-start"

# How long to wait for another daemon's claim on the state directory to go (storage/owner.py):
# a runtime-launched one exits when its runtime restarts.  Inside the Configure deadline.
CLAIM_WAIT = 1.0


class StateFile:
    def __init__(self, state_dir: str, progress: Progress | None = None) -> None:
        # The lock is waited for as long as it takes: the deadline (daemon/deadline.py), not
        # the lock's timeout, decides when the runtime is answered, and late work must not be
        # lost to a busy lock.
        self.store = StateStore(state_dir, lock_timeout=-1)
        self.progress = progress or NoProgress()
        # The state in memory is not the one in the file: a creation's commit waits for its
        # StartContainer (Node.hold), or a commit failed (a full disk).
        self.unsaved = False
        self._claim: tuple[str, int] | None = None  # (state directory, the claim's descriptor)

    @property
    def state_dir(self) -> str:
        return self.store.state_dir

    @contextlib.contextmanager
    def locked(self, decides: bool = True) -> Iterator[StateStore]:
        """Hold the state lock; the running job's progress says it waits for it, and no job
        that ``decides`` goes on once its request was answered with an error meanwhile (what
        takes a decision back, does)."""
        if self.store.holds_lock():
            yield self.store
            return
        with self.progress.phase(STATE_LOCK):
            lock = self.store.locked()
            lock.__enter__()
        try:
            if decides:
                self.progress.check()
            yield self.store
        finally:
            lock.__exit__(None, None, None)

    def write(self, state: NodeState) -> CommitTiming:
        """Write ``state`` (the lock held); raises OSError when it cannot be."""
        with self.progress.phase(COMMIT):
            return self.store.commit(state)

    def retarget(self, state_dir: str) -> None:
        """Use another state directory (the runtime's configuration moved it)."""
        if state_dir != self.store.state_dir:
            self.store = StateStore(state_dir, lock_timeout=-1)

    def claim(self) -> None:
        """Hold the daemon's claim on the state directory for as long as this process runs
        (again if the directory moved).  Raises ClaimError when another daemon holds it: two
        daemons would both answer for every container."""
        state_dir = self.store.state_dir
        if self._claim is not None:
            if self._claim[0] == state_dir:
                return
            self.release_claim()
        dir_fd = self.store.open_dir()
        try:
            self._claim = (state_dir, owner.claim(dir_fd, state_dir, CLAIM_WAIT))
        finally:
            os.close(dir_fd)

    def release_claim(self) -> None:
        """Give up the claim, as the kernel does when the process ends (tests run several
        daemons in turn in one process)."""
        if self._claim is not None:
            os.close(self._claim[1])
            self._claim = None


def commit_point(kind: str, exclusive: bool, runtime_lists: bool) -> str:
    """When a creation's (``CREATION``) or a stop's (``STOP``) decision is written: the rule
    of the module text."""
    if runtime_lists:
        return AT_START if kind == CREATION else AFTER_ANSWER
    return AFTER_ANSWER if kind == CREATION and not exclusive else BEFORE_ANSWER
