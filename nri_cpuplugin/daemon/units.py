"""The daemon's cpuset changes to containers of the systemd cgroup driver, made as systemd
keeps them: each container's scope gets its ``AllowedCPUs`` (and ``AllowedMemoryNodes``) as a
runtime property through systemd's D-Bus API (hardware/systemd_units.py), as runc does, so
that ``systemctl daemon-reload``, ``daemon-reexec`` or a ``set-property`` of the scope never
put an older cpuset back.  The writer (daemon/writer.py) writes the cgroup files as well.

All the units of one change (every shared container, when an exclusive one comes) go in one
pipelined batch on one connection, kept open; a unit systemd refused is the runtime's to apply
(the writer's caller puts it in a reply, or owes it).  A systemd slower than ``TIMEOUT`` (a
busy node, 100 units at once) does not make the runtime apply them too: the calls are sent and
systemd applies them in order, while the cgroup files written directly hold the cpusets
meanwhile.  Such a unit is remembered until systemd confirms it; one whose call was lost with
the connection is sent again with the next change, one systemd refused late is logged.  Runs on
the daemon's worker thread, which may block: the request's deadline (daemon/deadline.py)
answers in time if systemd is slow, and names the cause.
"""

from __future__ import annotations

from ..core.cpuset import CPUSet
from ..hardware import cpusets
from ..hardware import systemd_units as su
from ..hardware.systemd_client import SystemdClient
from ..hardware.systemd_units import SystemdError, unit_name
from ..ops import audit as audit_mod
from ..ops.audit import Audit

# How long one batch waits for systemd's answers: well inside a request's budget (1.5 s by
# default).  Calls unanswered by then stay pending (see above).
TIMEOUT = 1.0

Change = tuple[str, CPUSet, CPUSet | None]  # unit, cpus, mems


class SystemdUnits:
    def __init__(self, audit: Audit, path: str) -> None:
        self.audit = audit
        self.client = SystemdClient(path)
        self._said: set[str] = set()  # outcomes warned about (once each, not once per unit)
        self._pending: dict[str, Change] = {}  # sent, not yet confirmed by systemd
        self._resend: dict[str, Change] = {}  # pending calls lost with their connection

    def set_cpus(self, targets: list[cpusets.Target]) -> list[str]:
        """Set each target's unit properties; returns the ids of those systemd did not take."""
        changes, ids, failed = self._changes(targets)
        self._settle_late()
        changed = {change[0] for change in changes}
        again = [change for unit, change in self._resend.items() if unit not in changed]
        self._resend.clear()
        if not changes and not again:
            return failed
        sent = changes + again
        results = self.client.set_allowed(sent, TIMEOUT)
        for i, (change, result) in enumerate(zip(sent, results, strict=True)):
            if result.outcome == su.PENDING:
                self._pending[change[0]] = change
            else:
                self._pending.pop(change[0], None)
            if not result.ok:
                if i < len(ids):  # (a call sent again belongs to no target now)
                    failed.append(ids[i])
                self._warn(result.outcome, str(result.error))
        return failed

    def _changes(self, targets: list[cpusets.Target]) -> tuple[list[Change], list[str], list[str]]:
        """The calls to make, the ids they are for, and the ids no call can serve."""
        changes: list[Change] = []
        ids: list[str] = []
        failed: list[str] = []
        for target in targets:
            try:
                unit = unit_name(target.runtime_path)
            except SystemdError as err:  # a cgroupsPath from the runtime that names no unit
                self._warn("unit-name", str(err))
                failed.append(target.container_id)
                continue
            if unit is None or not target.cpus:
                failed.append(target.container_id)
                continue
            changes.append((unit, target.cpus, target.mems or None))
            ids.append(target.container_id)
        return changes, ids, failed

    def _settle_late(self) -> None:
        """The answers to calls left pending: confirmed ones forgotten, lost ones sent again,
        refused ones logged (the cgroup file written directly still holds the cpuset, but
        systemd would put the unit's older one back on its next re-apply)."""
        for unit, result in self.client.take_late().items():
            change = self._pending.pop(unit, None)
            if result.outcome in (su.UNREACHABLE, su.TIMEOUT):
                if change is not None:
                    self._resend[unit] = change
            elif not result.ok:
                self._warn(
                    f"late-{result.outcome}",
                    f"systemd refused a cpuset after the daemon had moved on ({result.error}); "
                    "the cgroup file holds it until systemd re-applies the unit's properties",
                )

    def _warn(self, outcome: str, message: str) -> None:
        """One warning per kind of failure: a systemd that cannot be reached fails every unit
        of every change, and the runtime applies them meanwhile (as without this writer)."""
        if outcome in self._said:
            return
        self._said.add(outcome)
        if not outcome.startswith("late-"):
            message = f"cpusets of systemd-driver containers are left to the runtime: {message}"
        self.audit.record("systemd", message, audit_mod.WARNING, reason=outcome)

    def close(self) -> None:
        self.client.close()
