"""The daemon's cpuset changes to containers of the systemd cgroup driver, made as systemd
keeps them: each container's scope gets its ``AllowedCPUs`` (and ``AllowedMemoryNodes``) as a
runtime property through systemd's D-Bus API (hardware/systemd_units.py), as runc does, so
that ``systemctl daemon-reload``, ``daemon-reexec`` or a ``set-property`` of the scope never
put an older cpuset back.  The writer (daemon/writer.py) writes the cgroup files first, so the
cpusets hold at once whatever systemd takes to answer.

All the units of one change (every shared container, when an exclusive one comes) go in one
pipelined batch on one connection, kept open; a unit systemd refused is the runtime's to apply
(the writer's caller puts it in a reply, or owes it).  A batch waits ``TIMEOUT`` for systemd's
answers and no longer: the calls are sent and systemd applies them in order, while the cgroup
files hold the cpusets meanwhile.  Such a unit is remembered until systemd answers; one whose
call was lost with the connection is sent again with the next change, one systemd refused late
is handed to the runtime after all (``take_refused``: owed to its next reply).  Runs on the
daemon's worker thread, which may block: the request's deadline (daemon/deadline.py) answers
in time if systemd is slow, and names the cause.
"""

from __future__ import annotations

from ..core.cpuset import CPUSet
from ..hardware import cpusets
from ..hardware import systemd_units as su
from ..hardware.systemd_client import SystemdClient
from ..hardware.systemd_units import SystemdError, unit_name
from ..ops import audit as audit_mod
from ..ops.audit import Audit

# How long one batch waits for systemd's answers.  Short: the cgroup files already hold the
# cpusets, and a pod start waits for this wait (an earmark changes every shared unit at once);
# quick refusals (a scope gone, a bus that says no) come back within it, later ones are owed
# to the runtime.  Calls unanswered by then stay pending.
TIMEOUT = 0.1

Change = tuple[str, CPUSet, CPUSet | None]  # unit, cpus, mems


class SystemdUnits:
    def __init__(self, audit: Audit, path: str) -> None:
        self.audit = audit
        self.client = SystemdClient(path)
        self._said: set[str] = set()  # outcomes warned about (once each, not once per unit)
        # by unit: (container id, call), sent and not yet answered by systemd
        self._pending: dict[str, tuple[str, Change]] = {}
        self._resend: dict[str, tuple[str, Change]] = {}  # pending calls lost with their connection
        self._refused: list[str] = []  # container ids systemd refused after set_cpus returned

    def set_cpus(self, targets: list[cpusets.Target]) -> list[str]:
        """Set each target's unit properties; returns the ids of those systemd did not take."""
        changes, ids, failed = self._changes(targets)
        self._settle_late()
        changed = {change[0] for change in changes}
        again = [item for unit, item in self._resend.items() if unit not in changed]
        self._resend.clear()
        if not changes and not again:
            return failed
        sent = list(zip(ids, changes, strict=True)) + again
        results = self.client.set_allowed([change for _, change in sent], TIMEOUT)
        for i, ((cid, change), result) in enumerate(zip(sent, results, strict=True)):
            if result.outcome == su.PENDING:
                self._pending[change[0]] = (cid, change)
            else:
                self._pending.pop(change[0], None)
            if not result.ok:
                if i < len(ids):
                    failed.append(cid)
                elif result.outcome != su.GONE:  # a call sent again: its reply has gone
                    self._refused.append(cid)
                self._warn(result.outcome, str(result.error))
        return failed

    def take_refused(self) -> list[str]:
        """Containers whose call systemd refused after ``set_cpus`` had returned (answered
        late, or sent again): the runtime's to apply.  Each told once."""
        refused, self._refused = self._refused, []
        return refused

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
        refused ones handed to the runtime (the cgroup file written directly holds the cpuset
        meanwhile, but systemd would put the unit's older one back on its next re-apply)."""
        for unit, result in self.client.take_late().items():
            item = self._pending.pop(unit, None)
            if result.outcome in (su.UNREACHABLE, su.TIMEOUT):
                if item is not None:
                    self._resend[unit] = item
            elif not result.ok:
                if item is not None and result.outcome != su.GONE:
                    self._refused.append(item[0])
                self._warn(
                    f"late-{result.outcome}",
                    f"systemd refused a cpuset after the daemon had moved on ({result.error}); "
                    "the runtime applies it with its next reply",
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
