"""The stored state as an engine takes it: the one load of both front ends.

The store checks the document against what the running policy requires (its name and reserved
CPUs; any CPU layout, which the engine follows in place), and the engine makes of it what to run
on: the state itself, a rebuilt one, or a new one (core/engine.py ``Engine.load``).
"""

from __future__ import annotations

from ..core.engine import Engine
from ..core.outcome import Loaded
from ..core.state import NodeState
from .store import Expected, StateStore


def load_state(
    store: StateStore, engine: Engine, announce: bool = True
) -> tuple[NodeState | None, Loaded]:
    """(the document as stored, or None; what the engine runs on).  The caller holds the lock,
    sets the file aside when ``Loaded.set_aside`` says so, and commits a state that changed.
    ``announce``: the informational state-new/state-loaded events (the daemon's, not every
    hook run's)."""
    policy = engine.policy
    result = store.load(Expected(policy.name, None, policy.reserved))
    return result.state, engine.load(result.state, result.problem, result.quarantined, announce)
