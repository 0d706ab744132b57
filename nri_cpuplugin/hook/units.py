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


def scope_changes(
    fs: CgroupFS, placed: Iterable[tuple[Record, Target]]
) -> tuple[list[Change], frozenset[str]]:
    """(unit, CPUs, memory nodes or None) of the written containers whose cgroup is a scope,
    and the units of those among them that hold exclusive CPUs."""
    changes: list[Change] = []
    exclusive = set()
    for record, target in placed:
        path = record.cgroups.cpuset
        unit = path.rsplit("/", 1)[-1]
        if not unit.endswith(".scope"):
            continue
        if target.exclusive:
            exclusive.add(unit)
        mems = target.mems
        if mems is None and target.mems_from_parent:
            try:  # what the container got back: its pod's memory nodes, as a list
                mems = fs.parent_mems(path)
            except CgroupError:
                mems = None
        changes.append((unit, target.cpus, mems or None))
    return changes, frozenset(exclusive)


def tell_systemd(
    changes: list[Change], setting: str, root: str, exclusive: frozenset[str], new: str = ""
) -> list[str]:
    """Hand the changed units over (hardware/systemd/handover.py), reading their configuration
    below ``root``; one line per unit systemd did not take (or why none could be), for the
    audit trail.  The ``exclusive`` units (containers that hold their CPUs) are set and kept,
    as the runtime keeps a scope created with a cpuset on the NRI path, so that systemd's view
    of a pinned container is the kernel's: once, when ``new`` (the container placed now) or
    while their configuration holds no cpuset, since their CPUs do not change while they run."""
    if not changes:
        return []
    from ..hardware.systemd import handover
    from ..hardware.systemd import units as su

    try:
        for unit, _, _ in changes:
            su.check_unit_name(unit)  # a unit name becomes a path and a D-Bus object path
        asked = [c for c in changes if _asked(c[0], root, exclusive, new)]
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
            results = handover.hand_over(client, asked, handover.TIMEOUT, keep=exclusive)
    except su.SystemdError as err:
        return [str(err)]
    return [f"{r.unit}: {r.error}" for r in results if not r.ok]


def _asked(unit: str, root: str, exclusive: frozenset[str], new: str) -> bool:
    from ..hardware.systemd import handover

    held = handover.asks_systemd(unit, root)  # holds a cpuset, or cannot be read
    return (unit == new or not held) if unit in exclusive else held
