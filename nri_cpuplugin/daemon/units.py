"""The daemon's cpuset changes to containers of the systemd cgroup driver, made as systemd
keeps them: each container's scope gets its ``AllowedCPUs`` (and ``AllowedMemoryNodes``) as a
runtime property through systemd's D-Bus API (hardware/systemd_units.py), as runc does, so
that ``systemctl daemon-reload``, ``daemon-reexec`` or a ``set-property`` of the scope never
put an older cpuset back.  The writer (daemon/writer.py) writes the cgroup files as well.

All the units of one change (every shared container, when an exclusive one comes) go in one
pipelined batch on one connection, kept open; a unit systemd did not take is the runtime's to
apply (the writer's caller puts it in a reply, or owes it).  Runs on the daemon's worker
thread, which may block: the request's deadline (daemon/deadline.py) answers in time if
systemd is slow, and names the cause.
"""

from __future__ import annotations

from ..hardware import cpusets
from ..hardware.systemd_client import SystemdClient
from ..hardware.systemd_units import SystemdError, unit_name
from ..ops import audit as audit_mod
from ..ops.audit import Audit

# How long one batch may wait for systemd: well inside a request's budget (1.5 s by default);
# a slower systemd makes the request miss its deadline, which says so.
TIMEOUT = 1.0


class SystemdUnits:
    def __init__(self, audit: Audit, path: str) -> None:
        self.audit = audit
        self.client = SystemdClient(path)
        self._said: set[str] = set()  # outcomes warned about (once each, not once per unit)

    def set_cpus(self, targets: list[cpusets.Target]) -> list[str]:
        """Set each target's unit properties; returns the ids of those systemd did not take."""
        changes = []
        ids = []
        failed = []
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
        if not changes:
            return failed
        for cid, result in zip(ids, self.client.set_allowed(changes, TIMEOUT), strict=True):
            if not result.ok:
                failed.append(cid)
                self._warn(result.outcome, str(result.error))
        return failed

    def _warn(self, outcome: str, message: str) -> None:
        """One warning per kind of failure: a systemd that cannot be reached fails every unit
        of every change, and the runtime applies them meanwhile (as without this writer)."""
        if outcome in self._said:
            return
        self._said.add(outcome)
        self.audit.record(
            "systemd",
            f"cpusets of systemd-driver containers are left to the runtime: {message}",
            audit_mod.WARNING,
            reason=outcome,
        )

    def close(self) -> None:
        self.client.close()
