"""The hook's cpuset changes to containers of the systemd cgroup driver, made as systemd keeps
them: after the cgroup files are written, each such container's scope gets the same CPUs (and
memory nodes) as its ``AllowedCPUs``/``AllowedMemoryNodes`` through systemd's D-Bus API
(hardware/systemd/units.py, client.py), so ``systemctl daemon-reload`` does not put an
older cpuset back.

The D-Bus client is imported only when a run changes a scope: on a cgroupfs node the hook's
start-up pays nothing for it.  What systemd does not take is reported, not fatal: the cgroups
are written already, and only a later re-application of the unit by systemd would undo them.
"""

from __future__ import annotations

from ..core.cpuset import CPUSet
from ..core.outcome import Target
from ..hardware.cgroupfs import CgroupError, CgroupFS
from .records import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

# One batch for the whole run, inside the runtime's hook timeout (CRI-O allows 2 s and more).
TIMEOUT = 1.0

Change = tuple[str, CPUSet, "CPUSet | None"]


def scope_changes(fs: CgroupFS, placed: Iterable[tuple[Record, Target]]) -> list[Change]:
    """(unit, CPUs, memory nodes or None) of the written containers whose cgroup is a scope."""
    changes = []
    for record, target in placed:
        path = record.cgroups.cpuset
        unit = path.rsplit("/", 1)[-1]
        if not unit.endswith(".scope"):
            continue
        mems = target.mems
        if mems is None and target.mems_from_parent:
            try:  # what the container got back: its pod's memory nodes, as a list
                mems = fs.parent_mems(path)
            except CgroupError:
                mems = None
        changes.append((unit, target.cpus, mems or None))
    return changes


def tell_systemd(changes: list[Change], setting: str) -> list[str]:
    """Set the units' properties; one line per unit systemd did not take (or why none could
    be), for the audit trail."""
    if not changes:
        return []
    from ..hardware.systemd import units as su  # only now: see the module docstring
    from ..hardware.systemd.client import SystemdClient

    path = su.bus_path(setting)
    if path is None:
        return [] if setting == "off" else ["no systemd bus found to keep the cpusets in"]
    try:
        for unit, _, _ in changes:
            su.check_unit_name(unit)
        with SystemdClient(path) as client:
            results = client.set_allowed(changes, TIMEOUT)
    except su.SystemdError as err:
        return [str(err)]
    return [f"{r.unit}: {r.error}" for r in results if not r.ok]
