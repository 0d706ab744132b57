"""The engine for the CPUs online now, after kernel uevents said some went offline or came
online: the topology discovered again, the policy's reserved CPUs and options kept."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.engine import Engine
from ..core.policy import PolicyError
from ..core.topology import TopologyError, discover
from ..hardware.hotplug import CPUEvent
from ..ops import audit as audit_mod
from ..ops.audit import Audit


def engine_for_online_cpus(
    sysfs: str, old: Engine, events: Iterable[CPUEvent], audit: Audit
) -> Engine | None:
    """The new engine; None (audited) when nothing changed or the new topology cannot be
    followed (the old one stays)."""
    what = describe(events)
    try:
        topology = discover(sysfs)
        if topology.fingerprint() == old.topology.fingerprint():
            audit.record("hotplug", f"{what}: no change in {sysfs}", audit_mod.DEBUG)
            return None
        engine = old.following(topology)
    except (TopologyError, PolicyError) as err:
        audit.record(
            "hotplug",
            f"{what}: cannot follow the new topology, keeping the old one: {err}",
            audit_mod.ERR,
            reason=str(err),
        )
        return None
    audit.record(
        "hotplug",
        f"{what}: online CPUs {old.topology.online} -> {topology.online}",
        audit_mod.NOTICE,
        cpus_offline=old.topology.online - topology.online,
        cpus_online=topology.online - old.topology.online,
    )
    return engine


def describe(events: Iterable[CPUEvent]) -> str:
    return ", ".join(f"CPU {e.cpu} {e.action}" if e.cpu >= 0 else e.action for e in events)
