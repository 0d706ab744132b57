"""The daemon's cpuset changes to containers of the systemd cgroup driver, made so that systemd
keeps them.  systemd writes a unit's ``AllowedCPUs``/``AllowedMemoryNodes`` back into its
cgroup whenever it re-applies the unit (``systemctl daemon-reload``, ``daemon-reexec``, a
``set-property``) - but only while the unit has one of them: a unit with neither keeps what its
cgroup files were given (docs/cgroups-and-hooks.md §21).  runc gives a scope the cpuset of the
container's spec; the daemon hands it over to the cgroup files once, the first time it changes
that container: ``SetUnitProperties`` with the new cpuset (so a re-apply meanwhile puts the
right one back), then with empty sets (systemd holds none from then on), both as runtime
properties through systemd's D-Bus API (hardware/systemd_units.py).  From then on the unit is
*bare*: the writer (daemon/writer.py) writes its cgroup files and systemd is not asked again -
on a dense node, an exclusive container's start costs no call per shared container.  A unit
whose configuration holds no cpuset already (a container created with none in its spec, or
handed over by an earlier run of the daemon) is bare from the start (hardware/unit_config.py).

The writer writes the cgroup files first, so the cpusets hold at once whatever systemd takes to
answer.  All the calls of one change go in one pipelined batch on one connection, kept open; a
unit systemd refused is the runtime's to apply (the writer's caller puts it in a reply, or owes
it), and one the runtime is given a cpuset for is not bare any more (``forget``).  A batch waits
``TIMEOUT`` for systemd's answers and no longer: the calls are sent and systemd applies them in
order, while the cgroup files hold the cpusets meanwhile.  Such a call is remembered until
systemd answers; one lost with the connection is sent again with the next change, one systemd
refused late is handed to the runtime after all (``take_refused``: owed to its next reply).
Runs on the daemon's worker thread, which may block: the request's deadline
(daemon/deadline.py) answers in time if systemd is slow, and names the cause.
"""

from __future__ import annotations

import time

from ..core.cpuset import CPUSet
from ..hardware import cpusets
from ..hardware import systemd_units as su
from ..hardware.systemd_client import SystemdClient
from ..hardware.systemd_units import SystemdError, unit_name
from ..hardware.unit_config import holds_cpuset
from ..ops import audit as audit_mod
from ..ops.audit import Audit

# How long one batch waits for systemd's answers.  Short: the cgroup files already hold the
# cpusets, and a pod start waits for this wait (an earmark changes every shared unit at once);
# quick refusals (a scope gone, a bus that says no) come back within it, later ones are owed
# to the runtime.  Calls unanswered by then stay pending.
TIMEOUT = 0.1
# The releases that follow a batch's sets share its wait; this much more at least, to send them.
SEND = 0.02

Change = tuple[str, CPUSet, CPUSet | None]  # unit, cpus, mems
NONE = CPUSet()  # a release: both sets empty (systemd_units.masks)


class SystemdUnits:
    def __init__(self, audit: Audit, path: str, root: str = "/") -> None:
        self.audit = audit
        self.client = SystemdClient(path)
        self.root = root  # where systemd's unit configuration is read (tests: a tree of files)
        # container id -> unit, for units systemd holds no cpuset for: their files are enough
        self._bare: dict[str, str] = {}
        self._said: set[str] = set()  # outcomes warned about (once each, not once per unit)
        # by unit: (container id, call), sent and not yet answered by systemd
        self._pending: dict[str, tuple[str, Change]] = {}
        self._resend: dict[str, tuple[str, Change]] = {}  # pending calls lost with their connection
        self._refused: list[str] = []  # container ids systemd refused after set_cpus returned

    def set_cpus(self, targets: list[cpusets.Target]) -> list[str]:
        """Make each target's cpuset one systemd keeps; returns the ids of those systemd did
        not take (their units, not bare, would get an older cpuset back)."""
        changes, ids, failed = self._changes(targets)
        self._settle_late()
        changed = {change[0] for change in changes}
        again = [item for unit, item in self._resend.items() if unit not in changed]
        self._resend.clear()
        if not changes and not again:
            return failed
        sent = list(zip(ids, changes, strict=True)) + again
        deadline = time.monotonic() + TIMEOUT
        results = self.client.set_allowed([change for _, change in sent], TIMEOUT)
        taken: list[tuple[str, str]] = []
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
            elif i < len(ids):
                taken.append((cid, change[0]))
        self._release(taken, max(deadline - time.monotonic(), SEND))
        return failed

    def _release(self, taken: list[tuple[str, str]], timeout: float) -> None:
        """Hand these units' cpusets over to their cgroup files: systemd applies a connection's
        calls in order, so each release follows the set that made the unit's cpuset right."""
        if not taken:
            return
        results = self.client.set_allowed([(unit, NONE, NONE) for _, unit in taken], timeout)
        for (cid, unit), result in zip(taken, results, strict=True):
            if result.ok:  # (one pending now and refused late is forgotten: _settle_late)
                self._bare[cid] = unit
            elif result.outcome != su.GONE:  # still systemd's, with the right cpuset
                self._warn(
                    f"release-{result.outcome}",
                    f"a unit's cpuset could not be handed over to its cgroup files "
                    f"({result.error}); systemd keeps it, and is asked again at the next change",
                )

    def forget(self, container_id: str) -> None:
        """The container's unit is given a cpuset by someone else now (the runtime, from a
        reply), or the container is gone: not bare any more."""
        self._bare.pop(container_id, None)

    def keep_only(self, container_ids: set[str]) -> None:
        for cid in self._bare.keys() - container_ids:
            del self._bare[cid]

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
            if target.container_id in self._bare:
                continue
            if holds_cpuset(unit, self.root) is False:  # never given one, or handed over
                self._bare[target.container_id] = unit
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
            if not result.ok:  # a set or a release that did not hold: the unit is systemd's
                self._forget_unit(unit)
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

    def _forget_unit(self, unit: str) -> None:
        for cid in [cid for cid, bare in self._bare.items() if bare == unit]:
            del self._bare[cid]

    def _warn(self, outcome: str, message: str) -> None:
        """One warning per kind of failure: a systemd that cannot be reached fails every unit
        of every change, and the runtime applies them meanwhile (as without this writer)."""
        if outcome in self._said:
            return
        self._said.add(outcome)
        if not outcome.startswith(("late-", "release-")):
            message = f"cpusets of systemd-driver containers are left to the runtime: {message}"
        self.audit.record("systemd", message, audit_mod.WARNING, reason=outcome)

    def close(self) -> None:
        self.client.close()
