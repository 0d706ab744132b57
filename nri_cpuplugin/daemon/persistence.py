"""The NRI daemon's state file (a part of CPUPlugin, kept apart for size): loading it at the
first Configure, the claim that makes an OCI hook on this node stand aside, and when a decision
is committed - before its answer, or after it where a crash between the two loses nothing
(docs/architecture.md, "When the state is committed")."""

from __future__ import annotations

import os

from ..core.engine import Outcome
from ..ops import audit as audit_mod
from ..storage import owner
from ..storage.store import Expected

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# How long to wait for another daemon's claim on the state directory to go (storage/owner.py):
# a runtime-launched one exits when its runtime restarts.  Inside the Configure deadline.
CLAIM_WAIT = 1.0


class StateKeeping:
    """Mixed into CPUPlugin, whose settings, engine, store, audit and metrics it uses
    (declared here for the reader; CPUPlugin defines them, and ``_learn_pinned`` and
    ``_repair_cgroups`` come from its other parts)."""

    _learn_pinned: Any
    _repair_cgroups: Any

    settings: Any
    engine: Any
    policy: Any
    store: Any
    audit: Any
    metrics: Any
    state: Any
    unverified: set[str]
    returned: Any
    _cgroups_stale: bool
    _claim: tuple[str, int] | None
    # The state in memory is not the one in the file: a creation's commit waits for its
    # StartContainer (_hold), or a commit failed (a full disk).  The next commit writes it.
    _unsaved: bool

    def load_state(self) -> None:
        """Read the state file; anything unusable is set aside and we start from empty (the
        runtime's Synchronize, or the next events, fill it in).  Never refuses to start."""
        self._claim_state_dir()
        policy = self.policy
        with self.store.locked(timeout=-1):
            result = self.store.load(Expected(policy.name, None, policy.reserved))
            loaded = self.engine.load(result.state, result.problem, result.quarantined)
            if loaded.set_aside:
                self.store.set_aside()
            if loaded.state == result.state:  # nothing changed: nothing written (a full disk)
                self.state = loaded.state
            else:
                self._commit(Outcome(loaded.state))
        self.audit.emit(loaded.events)
        state = self.state
        self.unverified = set(state.assignments) | set(state.sharing)
        if not loaded.trusted:
            self._learn_pinned()
        if loaded.followed is not None and loaded.trusted:
            # Repair the containers we know now (containerd 1.7 sends a launched plugin no
            # Synchronize), and again at Synchronize for those only the runtime knows.
            self._repair_cgroups(sorted(set(state.assignments) | set(state.sharing)))
            self._cgroups_stale = True
            self.returned = self.policy.topology.online

    def _claim_state_dir(self) -> None:
        """Hold the daemon's claim on the state directory for as long as this process runs
        (again if the runtime's configuration moved it).  Raises ClaimError when another
        daemon holds it: two daemons would both answer for every container."""
        state_dir = self.settings.state_dir
        if self._claim is not None:
            if self._claim[0] == state_dir:
                return
            os.close(self._claim[1])
            self._claim = None
        dir_fd = self.store.open_dir()
        try:
            self._claim = (state_dir, owner.claim(dir_fd, state_dir, CLAIM_WAIT))
        finally:
            os.close(dir_fd)

    def release_claim(self) -> None:
        """Give up the claim on the state directory, as the kernel does when the process ends
        (tests run several daemons in turn in one process)."""
        if self._claim is not None:
            os.close(self._claim[1])
            self._claim = None

    def _commit(self, outcome: Outcome, durable: bool = False) -> Outcome:
        """Commit the outcome's state (the caller holds the lock) before anything is applied.

        A state that cannot be written (a full disk, a read-only directory) is kept in memory
        and written with the next commit that succeeds - what shared containers run on can
        always be derived again - unless ``durable``: an exclusive assignment that a crash
        could forget must not be handed out, so the error goes to the caller."""
        new_state = outcome.state
        # The engine returns the very state it was given when nothing changed.
        if new_state is self.state and not self._unsaved:
            return outcome
        try:
            timing = self.store.commit(new_state)
        except OSError as err:
            if durable:
                raise
            self._unsaved = True
            self.audit.record(
                "state-unsaved",
                f"the state could not be written, kept in memory until it can: {err}",
                audit_mod.WARNING,
                reason=str(err),
            )
        else:
            self._unsaved = False
            self.metrics.observe_commit(timing.total_seconds)
        self.state = new_state
        self.metrics.observe_state(new_state, self.policy.topology)
        return outcome

    def _hold(self, outcome: Outcome) -> None:
        """Take the outcome's state without writing it yet: a creation's is committed by its
        StartContainer, before the container's first instruction, while the runtime waits for
        that answer instead of storing the container (docs/architecture.md, "When the state is
        committed"); a stop's right after its answer.  Only once the runtime lists its
        containers at every connection: a crash meanwhile loses nothing it would not list
        again."""
        if outcome.state is not self.state:
            self.state = outcome.state
            self._unsaved = True
            self.metrics.observe_state(outcome.state, self.policy.topology)

    def _write_held(self) -> None:
        """Commit the state held in memory, if the file lags behind it (``_hold``, or a
        commit that failed)."""
        if self._unsaved:
            with self.store.locked():
                self._commit(Outcome(self.state))
