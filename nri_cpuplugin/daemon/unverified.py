"""Containers the NRI daemon knows only from its state file (a part of CPUPlugin, kept apart
for size): after a restart without Synchronize (containerd 1.7 sends none to a plugin it
launched) they may end unseen, and after a lost state, running containers may be pinned to
CPUs the state does not name.  Both are checked against the cgroups - when their CPUs are
needed, and a few at a time in the background - so that no event pays for all of them."""

from __future__ import annotations

import logging

from ..core.cpuset import CPUSet
from ..core.engine import Outcome
from ..hardware.liveness import pinned_cpus
from ..ops import audit as audit_mod

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("nri_cpuplugin")

# Containers known only from the state file are checked this many at a time, this often
# (a check reads one or two cgroup files).
SWEEP_INTERVAL, SWEEP_BATCH = 2.0, 32
# ... and the CPUs pinned by containers a lost state named are looked for every this many sweeps.
PINNED_EVERY = 5


class UnverifiedContainers:
    """Mixed into CPUPlugin, whose state, engine, store and audit it uses (declared here for
    the reader; CPUPlugin defines them, and ``_commit`` and ``_push``)."""

    _commit: Any
    _push: Any

    unverified: set[str]
    pinned: CPUSet
    engine: Any
    state: Any
    store: Any
    audit: Any
    liveness: Any
    _sweeping: bool
    _sweeps: int
    _swept_to: str

    def _forget_ended(self, exclusive_only: bool = False, limit: int | None = None) -> Outcome:
        """Release unverified containers whose cgroups show they have ended (see liveness.py):
        those holding exclusive CPUs only, or the next ``limit`` of them in turn (the sweep);
        the caller holds the lock.  Returns what was released (its events are recorded)."""
        state = self.state
        candidates = sorted(self.unverified)
        if exclusive_only:
            candidates = [cid for cid in candidates if cid in state.assignments]
        elif limit is not None:
            # In turn: after the last one checked, wrapping around.
            later = [cid for cid in candidates if cid > self._swept_to]
            candidates = (later + [cid for cid in candidates if cid <= self._swept_to])[:limit]
            if candidates:
                self._swept_to = candidates[-1]
        ended = []
        for cid in candidates:
            if cid not in state.assignments and cid not in state.sharing:
                self.unverified.discard(cid)
            # Alive, or cannot tell: stays unverified (it may still end unseen, later).
            elif self.liveness.alive(state.cgroups.get(cid, "")) is False:
                self.unverified.discard(cid)
                ended.append(cid)
        if not ended:
            return Outcome(state)
        why = "its cgroup is gone or empty, and the runtime could not tell us"
        outcome = self._commit(self.engine.ended(state, ended, why))
        self.audit.emit(outcome.events)
        return outcome

    def _recheck_holders(self) -> bool:
        """Whether CPUs came free: unverified exclusive holders that ended, or containers
        pinned before the state was lost that are gone."""
        freed = bool(self._forget_ended(exclusive_only=True).events)
        if self.pinned:
            before = self.pinned
            self._learn_pinned()
            freed = freed or self.pinned != before
        return freed

    def _learn_pinned(self) -> None:
        """The state is lost (or new): which CPUs are running containers pinned to?  Until the
        runtime says (Synchronize - containerd 1.7 never sends one to a plugin it launched),
        those are kept out of exclusive use, so that no CPU is given twice."""
        pinned = pinned_cpus(self.liveness.root) - self.state.exclusive
        if pinned != self.pinned and (pinned or self.pinned):
            self.audit.record(
                "reconcile",
                f"running containers are pinned to CPUs {pinned or 'none'} that the state does "
                "not name (it was lost): kept out of exclusive use until the runtime lists its "
                "containers",
                audit_mod.WARNING if pinned else audit_mod.INFO,
                cpus=pinned,
                reason="state lost",
            )
        self.pinned = pinned

    def _start_sweep(self) -> None:
        """Check the unverified containers a few at a time on the event loop, so the shared
        pool grows back when some of them ended, without any event paying for all of them."""
        if self._sweeping or not (self.unverified or self.pinned):
            return
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._sweep_later(loop)

    def _sweep_later(self, loop: Any) -> None:
        self._sweeping = True
        loop.call_later(SWEEP_INTERVAL, self._sweep, loop)

    def _sweep(self, loop: Any) -> None:
        self._sweeping = False
        if self._sweep_once():
            self._sweep_later(loop)

    def _sweep_once(self) -> bool:
        """One round of the sweep; whether there is more to check later."""
        if self.state is None:
            return False
        # Containers pinned before the state was lost may have ended.  The scan walks every pod
        # cgroup (tens of milliseconds on a large node, which events wait for): not every sweep.
        self._sweeps += 1
        if self.pinned and self._sweeps % PINNED_EVERY == 0:
            self._learn_pinned()
        if not self.unverified and not self.pinned:
            return False
        try:
            with self.store.locked():
                outcome = self._forget_ended(limit=SWEEP_BATCH)
        except Exception as err:  # a busy lock or a full disk: try again later
            log.warning("checking unverified containers failed: %s", err)
        else:
            self._push(outcome.targets, "ended unseen")
        return bool(self.unverified or self.pinned)
