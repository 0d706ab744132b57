"""The hand-over of a scope's cpuset from systemd to its cgroup files: one policy for the NRI
daemon (daemon/units.py) and the OCI hook (hook/units.py).

systemd writes a unit's ``AllowedCPUs``/``AllowedMemoryNodes`` back into its cgroup whenever it
re-applies the unit, but only while the unit has one of them (docs/cgroups-and-hooks.md §21).
So a change to a container's cpuset goes to systemd only while the unit's configuration holds a
cpuset (unit_config.py; one that cannot be read is taken as holding one): the unit is set to the
new cpuset (a re-apply meanwhile puts the right one back), then released - both sets empty -
on the same connection, so systemd applies the release after the set.  The release lands in
the unit's configuration (a runtime drop-in), so from then on the unit holds none: it is
*bare*, its cgroup files are written directly and systemd is not asked again - not by this
process, and not by the next one, which reads the same files.  On a dense node an exclusive
container's start then costs no call per shared container.

The cgroup files are written before systemd is asked, so the cpusets hold at once however long
systemd takes; one batch waits ``TIMEOUT`` for its answers and no longer (systemd applies what
was sent, in order).
"""

from __future__ import annotations

import time

from ...core.cpuset import CPUSet
from .unit_config import holds_cpuset
from .units import PENDING, SET, UnitResult

TYPE_CHECKING = False  # typing is not imported at run time (the hook's start-up cost)
if TYPE_CHECKING:
    from .client import SystemdClient

    Change = tuple[str, CPUSet, CPUSet | None]  # unit, cpus, mems

# How long one batch waits for systemd's answers.  Short: the cgroup files already hold the
# cpusets, and a pod start waits for this wait; quick refusals (a scope gone, a bus that says
# no) come back within it.  Calls unanswered by then are applied by systemd all the same.
TIMEOUT = 0.1
# The releases that follow a batch's sets share its wait; this much more at least, to send them.
SEND = 0.02
NONE = CPUSet()  # a release: both sets empty (units.py masks)
NO_UNITS: frozenset[str] = frozenset()


def asks_systemd(unit: str, root: str) -> bool:
    """Whether a change to the unit's cpuset goes to systemd: its configuration holds a
    cpuset, or cannot be read (never taken as bare, which a ``daemon-reload`` would undo).
    ``unit`` must be a checked unit name (units.check_unit_name): it becomes a path."""
    return holds_cpuset(unit, root) is not False


def releases(units: list[str]) -> list[Change]:
    """The calls that leave systemd no cpuset for these units."""
    return [(unit, NONE, NONE) for unit in units]


def releasable(result: UnitResult) -> bool:
    """Whether a unit's set went through, or is on its way: systemd applies a connection's
    calls in order, so its release, sent after it, follows it."""
    return result.outcome in (SET, PENDING)


def hand_over(
    client: SystemdClient, changes: list[Change], timeout: float, keep: frozenset[str] = NO_UNITS
) -> list[UnitResult]:
    """Set each unit's cpuset, then release those set (or on their way) but the ``keep``
    ones, one connection and one wait of ``timeout`` for both; the result of each set, in
    order.  For a process that asks once (the hook): the daemon follows its calls up
    (daemon/units.py)."""
    deadline = time.monotonic() + timeout
    results = client.set_allowed(changes, timeout)
    done = [r.unit for r in results if releasable(r) and r.unit not in keep]
    if done:
        client.set_allowed(releases(done), max(deadline - time.monotonic(), SEND))
    return results
