"""The hook's cpuset changes to containers of the systemd cgroup driver, made so that systemd
keeps them, by the daemon's hand-over policy (hardware/systemd/handover.py): once the cgroup
files are written, a scope whose unit configuration still holds a cpuset is set to the same CPUs
(and memory nodes) through systemd's D-Bus API, then released; a scope that holds none - never
given one, or handed over by an earlier run - is asked nothing.  So on a dense node an
exclusive container's start asks systemd nothing for the shared containers once they were
handed over.

The D-Bus client is imported only when a run asks systemd something: on a cgroupfs node, and
for scopes handed over, the hook's start-up pays nothing for it.  What systemd does not take is
reported, not fatal: the cgroups are written already, and only a later re-application of the
unit by systemd would undo them.
"""

from __future__ import annotations

from ..core.outcome import Target
from ..hardware.cgroupfs import CgroupError, CgroupFS
from .records import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..hardware.systemd.handover import Change


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


def tell_systemd(changes: list[Change], setting: str, root: str) -> list[str]:
    """Hand the changed units over (hardware/systemd/handover.py), reading their configuration
    below ``root``; one line per unit systemd did not take (or why none could be), for the
    audit trail."""
    if not changes:
        return []
    from ..hardware.systemd import handover
    from ..hardware.systemd import units as su

    try:
        asked = [c for c in changes if handover.asks_systemd(su.check_unit_name(c[0]), root)]
    except su.SystemdError as err:
        return [str(err)]
    if not asked:
        return []  # every scope handed over already: its cgroup files are all it takes
    path = su.bus_path(setting)
    if path is None:
        return [] if setting == "off" else ["no systemd bus found to keep the cpusets in"]
    from ..hardware.systemd.client import SystemdClient  # only now: see the module docstring

    try:
        with SystemdClient(path) as client:
            results = handover.hand_over(client, asked, handover.TIMEOUT)
    except su.SystemdError as err:
        return [str(err)]
    return [f"{r.unit}: {r.error}" for r in results if not r.ok]
