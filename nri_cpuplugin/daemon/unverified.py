"""Containers the daemon knows only from its state file, not (yet) from the runtime.

After a restart without Synchronize (containerd 1.7 sends none to a plugin it launched) they
may end unseen.  They are checked against their cgroups - those holding exclusive CPUs when
their CPUs are needed, and the rest a few at a time by the sweep (daemon/node.py) - so that
no event pays for all of them.  Containers created in this session are never in here: before
their start they have no cgroup, which must not read as "ended".
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.state import NodeState
from ..hardware.liveness import Liveness

# Containers known only from the state file are checked this many at a time, this often
# (a check reads one or two cgroup files).
SWEEP_INTERVAL, SWEEP_BATCH = 2.0, 32
# ... and the CPUs pinned by containers a lost state named are looked for every this many sweeps.
PINNED_EVERY = 5


class Unverified:
    def __init__(self, container_ids: Iterable[str] = ()) -> None:
        self._ids = set(container_ids)
        self._swept_to = ""  # the last container id the sweep checked
        self.sweeps = 0

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        """The runtime listed its containers: every one is known now."""
        self._ids.clear()

    def ended(
        self, state: NodeState, liveness: Liveness, exclusive_only: bool = False, limit: int = 0
    ) -> list[str]:
        """Those whose cgroups show they have ended (hardware/liveness.py): the ones holding
        exclusive CPUs, or the next ``limit`` in turn (the sweep), or all.  Checked ones that
        are alive, or cannot be told, stay: they may still end unseen later."""
        candidates = sorted(self._ids)
        if exclusive_only:
            candidates = [cid for cid in candidates if cid in state.assignments]
        elif limit:
            # In turn: after the last one checked, wrapping around.
            later = [cid for cid in candidates if cid > self._swept_to]
            candidates = (later + [cid for cid in candidates if cid <= self._swept_to])[:limit]
            if candidates:
                self._swept_to = candidates[-1]
        ended = []
        for cid in candidates:
            if cid not in state.assignments and cid not in state.sharing:
                self._ids.discard(cid)
            elif liveness.alive(state.cgroups.get(cid, "")) is False:
                self._ids.discard(cid)
                ended.append(cid)
        return ended
