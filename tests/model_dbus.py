"""FAKE systemd's D-Bus side, for the model (tests/model_runtime.py) with the daemon's real
``SystemdUnits`` (daemon/units.py): ``ModelClient`` stands in place of the D-Bus client
(hardware/systemd/client.py) and talks to ``DBusSystemd``, the model's FAKE systemd, which
applies each ``SetUnitProperties`` to its scope (the property kept, the cgroup written; a
release keeps none) and keeps each scope's unit files as systemd does (the transient unit as
runc created it, a drop-in per property set since), where the daemon reads them.

Its faults: systemd busy (calls queue unread, answered PENDING), answering late (refusals among
them: a scope that refuses), re-executing (every connection closed, the unread calls lost with
it; every unit's properties written into its cgroup again; the daemon finds the connection
closed at its next read or send), and its unit files hidden from the daemon.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from fake_cgroup_v1 import FakeCgroupV1
from model_runtime import FakeSystemd

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware.systemd import units as su
from nri_cpuplugin.hardware.systemd.units import SystemdError, UnitResult

PREFIX, SUFFIX = "cri-containerd-", ".scope"
CLOSED = SystemdError("systemd's D-Bus connection failed: Broken pipe (a re-exec)", "closed")


class DBusSystemd(FakeSystemd):
    """FAKE systemd (model_runtime.FakeSystemd) reached over FAKE D-Bus (``ModelClient``)."""

    def __init__(self, cgroups: FakeCgroupV1, root: Path) -> None:
        super().__init__(cgroups)
        self.root = root  # the host's root, as the daemon is told it
        self.hidden = False  # the unit files not where the daemon looks
        self.scopes: dict[str, str] = {}  # unit -> cgroup path, of the scopes that exist
        self.busy = False
        self.queue: list[tuple[str, CPUSet]] = []  # calls sent, not read yet: (unit, cpus)
        self.answers: list[UnitResult] = []  # late answers the daemon has not read
        self.broken = False  # a re-exec closed the daemon's connection; it has not noticed
        self.lost: list[str] = []  # the units of the calls lost with it
        self._transient().mkdir(parents=True)

    # --- runc's side (model_runtime.Runtime) ----------------------------------------------------

    def created(self, path: str, cpus: CPUSet | None) -> None:
        super().created(path, cpus)
        unit = unit_of(path)
        self.scopes[unit] = path
        line = f"AllowedCPUs={cpus}\n" if cpus else ""
        self._write(unit, "", f"[Scope]\nDelegate=yes\n{line}")

    def keep(self, path: str, cpus: CPUSet) -> None:
        super().keep(path, cpus)
        self._write(unit_of(path), "50-AllowedCPUs.conf", f"[Scope]\nAllowedCPUs={cpus}\n")

    def forget(self, path: str) -> None:
        super().forget(path)
        unit = unit_of(path)
        if self.scopes.pop(unit, None) is not None:
            transient = self._transient()
            (transient / unit).unlink(missing_ok=True)
            shutil.rmtree(transient / f"{unit}.d", ignore_errors=True)

    # --- the daemon's side (``ModelClient``) -------------------------------------------------

    def call(self, unit: str, cpus: CPUSet) -> UnitResult:
        """One SetUnitProperties as systemd applies it (cpus empty: a release)."""
        path = self.scopes.get(unit)
        if path is None or not self.cgroups.exists(path):
            return UnitResult(unit, su.GONE, SystemdError(f"Unit {unit} not loaded.", "gone"))
        if unit.removeprefix(PREFIX).removesuffix(SUFFIX) in self.refusing:
            return UnitResult(unit, su.DENIED, SystemdError("Access denied", "denied"))
        if cpus:
            self.set_allowed(path, cpus)
        else:
            self.allowed.pop(path, None)
        self._write(unit, "50-AllowedCPUs.conf", f"[Scope]\nAllowedCPUs=\nAllowedCPUs={cpus}\n")
        return UnitResult(unit, su.SET)

    def answer(self) -> int:
        """systemd works through the calls it had not read: answered late, in order."""
        queue, self.queue, self.busy = self.queue, [], False
        self.answers += [self.call(unit, cpus) for unit, cpus in queue]
        return len(queue)

    def reexec(self) -> list[str]:
        """daemon-reexec: the unread calls lost, the connection closed, every unit's
        properties written into its cgroup again (the paths that changed); it serves the
        next connection at once."""
        self.lost += [unit for unit, _ in self.queue]
        self.queue, self.busy, self.broken = [], False, True
        return self.daemon_reload()

    def found_closed(self) -> None:
        """The daemon reads its connection's end: each call lost is answered unreachable."""
        self.broken = False
        self.answers += [UnitResult(unit, su.UNREACHABLE, CLOSED) for unit in self.lost]
        self.lost = []

    def hide(self, hidden: bool) -> None:
        if hidden != self.hidden:
            shown, away = self.root / "run", self.root / "run-hidden"
            (shown if hidden else away).rename(away if hidden else shown)
            self.hidden = hidden

    def _transient(self) -> Path:
        return self.root / ("run-hidden" if self.hidden else "run") / "systemd" / "transient"

    def _write(self, unit: str, dropin: str, text: str) -> None:
        path = self._transient() / (f"{unit}.d/{dropin}" if dropin else unit)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


class ModelClient:
    """The D-Bus client's place (hardware/systemd/client.py ``SystemdClient``) on FAKE D-Bus."""

    def __init__(self, systemd: DBusSystemd) -> None:
        self.systemd = systemd

    def set_allowed(
        self, changes: Iterable[tuple[str, Iterable[int], Iterable[int] | None]], timeout: float
    ) -> list[UnitResult]:
        systemd = self.systemd
        changes = list(changes)
        if systemd.broken:  # the send finds the connection closed: the batch fails with it
            systemd.found_closed()
            return [UnitResult(unit, su.UNREACHABLE, CLOSED) for unit, *_ in changes]
        results = []
        for unit, cpus, _ in changes:
            if systemd.busy:
                systemd.queue.append((unit, CPUSet(cpus)))
                results.append(UnitResult(unit, su.PENDING))
            else:
                results.append(systemd.call(unit, CPUSet(cpus)))
        return results

    def take_late(self) -> list[UnitResult]:
        answers, self.systemd.answers = self.systemd.answers, []
        return answers

    def collect(self, timeout: float) -> None:
        if self.systemd.broken and self.systemd.lost:  # (reads only while calls are pending)
            self.systemd.found_closed()

    def close(self) -> None:
        pass


def unit_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
