"""The daemon's cpuset changes to containers of the systemd cgroup driver, made so that systemd
keeps them.  systemd writes a unit's ``AllowedCPUs``/``AllowedMemoryNodes`` back into its
cgroup whenever it re-applies the unit (``systemctl daemon-reload``, ``daemon-reexec``, a
``set-property``) - but only while the unit has one of them: a unit with neither keeps what its
cgroup files were given (docs/cgroups-and-hooks.md §21).  runc gives a scope the cpuset of the
container's spec; the daemon hands it over to the cgroup files once, the first time it changes
that container: ``SetUnitProperties`` with the new cpuset (so a re-apply meanwhile puts the
right one back), then with empty sets (systemd holds none from then on), both as runtime
properties through systemd's D-Bus API (hardware/systemd/units.py), by the policy the OCI
hook shares (hardware/systemd/handover.py).  From then on the unit is
*bare*: the writer (daemon/writer.py) writes its cgroup files and systemd is not asked again -
on a dense node, an exclusive container's start costs no call per shared container.  A unit is
bare only once systemd has confirmed its release; until then every change to it is asked of
systemd too.  A unit whose configuration holds no cpuset already (a container created with
none in its spec, or handed over by an earlier run of the daemon) is bare from the start
(hardware/systemd/unit_config.py); one whose configuration cannot be read is taken as holding one
(asked, then released: never taken as bare, which a ``daemon-reload`` would undo), and that is
said once.

The writer writes the cgroup files first, so the cpusets hold at once whatever systemd takes to
answer.  All the calls of one change go in one pipelined batch on one connection, kept open; a
unit systemd refused is the runtime's to apply (the writer's caller puts it in a reply, or owes
it), and one the runtime is given a cpuset for is not bare any more (``forget``).  A batch waits
``TIMEOUT`` for systemd's answers and no longer: the calls are sent and systemd applies them in
order, while the cgroup files hold the cpusets meanwhile.  Until a unit is bare its hand-over
is open (``HandOver``): its calls are counted until systemd has answered each, and it keeps
the cpuset the daemon wants for it now, so that a call lost with its connection (systemd closes
them all when it re-executes, unread calls with them) is sent again with that cpuset - never the
one first sent, which the pool may have left since - and its release after it.  A connection
found broken is opened again at once, within the same change; what is still unconfirmed after
a change is followed up off the request path (``finish``, scheduled through ``wake``: soon,
then less and less often), so that a loss is found and got over even when no change comes.
One systemd refused late is handed to the runtime after all (``take_refused``: owed to its
next reply), unless a change asks it again.
Runs on the daemon's worker thread, which may block: the request's deadline
(daemon/deadline.py) answers in time if systemd is slow, and names the cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..core.cpuset import CPUSet
from ..hardware import cpusets
from ..hardware.systemd import units as su
from ..hardware.systemd.client import SystemdClient
from ..hardware.systemd.handover import SEND, TIMEOUT, asks_systemd, releasable, releases
from ..hardware.systemd.unit_config import unseen
from ..hardware.systemd.units import SystemdError, UnitResult, unit_name
from ..ops import audit as audit_mod
from ..ops.audit import Audit

# Seconds before each follow-up (``finish``) while a hand-over is unfinished: soon after a
# re-exec (systemd takes a moment to come back), then ever less often, never rarer than the last.
FOLLOW_UP = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
LOST = (su.UNREACHABLE, su.TIMEOUT)  # not applied as far as we know: to be sent again

Change = tuple[str, CPUSet, CPUSet | None]  # unit, cpus, mems
Item = tuple[str, Change]  # container id, change
Outcome = tuple[str, UnitResult]  # container id, what became of its set


class HandOver:
    """A unit on its way to bare: the cpuset it is to have now (the latest target given, which
    a call sent again carries), and what became of the calls made for it."""

    __slots__ = ("calls", "change", "cid", "dropped", "lost", "released", "told")

    def __init__(self, cid: str, change: Change) -> None:
        self.cid = cid
        self.change = change
        self.calls = 0  # sent and not answered yet (pending)
        self.released = False  # the last call sent for it is its release
        self.lost = False  # its last call was lost with its connection, or never sent
        self.told = False  # handed to the runtime already (it applies the target as well)
        # the runtime's now, or gone: only counted until its calls are answered, then dropped
        # (so that their answers are not taken for those of calls made for it later)
        self.dropped = False


class SystemdUnits:
    def __init__(
        self,
        audit: Audit,
        path: str,
        root: str = "/",
        wake: Callable[[float], bool] | None = None,
    ) -> None:
        self.audit = audit
        self.client = SystemdClient(path)
        self.root = root  # where systemd's unit configuration is read (tests: a tree of files)
        # Schedules ``finish`` on the daemon's worker after so many seconds (False: cannot)
        self.wake = wake
        # container id -> unit, for units systemd holds no cpuset for: their files are enough
        self._bare: dict[str, str] = {}
        self._open: dict[str, HandOver] = {}  # by unit: hand-overs not confirmed yet
        self._said: set[str] = set()  # outcomes warned about (once each, not once per unit)
        self._refused: list[str] = []  # container ids the runtime must apply after all
        self._broke = False  # a connection systemd closed (a re-exec) since this was reset
        self._waking = False  # a follow-up is scheduled
        self._tries = 0  # follow-ups in a row that left something unfinished

    def set_cpus(self, targets: list[cpusets.Target]) -> list[str]:
        """Make each target's cpuset one systemd keeps; returns the ids of those systemd did
        not take (their units, not bare, would get an older cpuset back)."""
        deadline = time.monotonic() + TIMEOUT
        self._settle_late()  # first: a unit refused or lost late is asked again by this change
        self._broke = False
        changes, failed = self._changes(targets)
        asked = {change[0]: cid for cid, change in changes}
        again = set(asked.values())  # (asked again: the new call's outcome is what counts)
        self._refused = [cid for cid in self._refused if cid not in again]
        outcomes = self._hand_over(changes + self._lost(asked), deadline)
        if self._broke and deadline - time.monotonic() > SEND:
            # systemd closed the connection (daemon-reexec): open another and finish now, with
            # what each unit is to have now - not at some later event
            self._broke = False
            outcomes.update(self._hand_over(self._lost(), deadline))
        failed += self._route(outcomes, asked)
        self._follow_up()
        return failed

    def finish(self) -> list[str]:
        """The follow-up, on the daemon's worker: read what became of the calls left pending
        (confirmed, refused, or lost with a connection systemd closed) and send the lost ones
        again; returns the containers that are the runtime's to apply after all (owed to its
        next reply).  Waits TIMEOUT for systemd at most."""
        self._waking = False
        deadline = time.monotonic() + TIMEOUT
        self.client.collect(TIMEOUT)
        self._settle_late()
        self._route(self._hand_over(self._lost(), deadline), {})
        self._follow_up()
        return self.take_refused()

    def _hand_over(self, items: list[Item], deadline: float) -> dict[str, Outcome]:
        """Set each unit's cpuset, then release the units whose set systemd took or will
        apply (systemd applies a connection's calls in order, so each release follows the set
        that made the unit's cpuset right); the result of each unit's set."""
        if not items:
            return {}
        timeout = max(deadline - time.monotonic(), SEND)
        results = self.client.set_allowed([change for _, change in items], timeout)
        self._settle_late()  # (answers to older calls: they came before these)
        releases: list[HandOver] = []
        outcomes: dict[str, Outcome] = {}
        for (cid, change), result in zip(items, results, strict=True):
            unit = change[0]
            outcomes[unit] = (cid, result)
            self._note(result)
            hand_over = self._open.pop(unit, None) or HandOver(cid, change)
            hand_over.cid, hand_over.change, hand_over.dropped = cid, change, False
            if releasable(result):
                hand_over.calls += result.outcome == su.PENDING
                hand_over.lost = hand_over.released = False
                releases.append(hand_over)
            elif result.outcome in LOST:
                hand_over.lost, hand_over.released = True, False
            else:  # gone, or refused: not ours to hand over
                continue
            self._open[unit] = hand_over
        if releases:
            self._release(releases, max(deadline - time.monotonic(), SEND))
        return outcomes

    def _release(self, hand_overs: list[HandOver], timeout: float) -> None:
        results = self.client.set_allowed(releases([h.change[0] for h in hand_overs]), timeout)
        self._settle_late()  # (the answers to these units' sets left pending)
        for hand_over, result in zip(hand_overs, results, strict=True):
            unit = hand_over.change[0]
            self._note(result)
            if self._open.get(unit) is not hand_over:
                continue  # its set was refused late, or its unit is gone
            if result.outcome == su.PENDING:
                hand_over.calls += 1
                hand_over.released = True
            elif result.outcome == su.SET:
                hand_over.released = True
                self._settled(unit, hand_over)
            elif result.outcome in LOST:
                hand_over.lost = True
            else:  # gone; or refused: systemd keeps the right cpuset, asked at the next change
                self._open.pop(unit, None)
                if result.outcome != su.GONE:
                    self._warn(
                        f"release-{result.outcome}",
                        f"a unit's cpuset could not be handed over to its cgroup files "
                        f"({result.error}); systemd keeps it, and is asked again at the next "
                        "change",
                    )

    def _settled(self, unit: str, hand_over: HandOver) -> None:
        """Every call of the unit answered, its release last: bare from now on."""
        if hand_over.calls == 0 and hand_over.released and not hand_over.lost:
            self._open.pop(unit, None)
            self._bare[hand_over.cid] = unit

    def _route(self, outcomes: dict[str, Outcome], asked: dict[str, str]) -> list[str]:
        """The ids of the changes asked now that systemd did not take (the runtime's, in the
        reply); a call sent again that failed is the runtime's too, once (``take_refused``)."""
        failed: list[str] = []
        for unit, (cid, result) in outcomes.items():
            if result.ok:
                continue
            self._warn(result.outcome, str(result.error))
            hand_over = self._open.get(unit)
            if unit in asked:
                failed.append(cid)
                if hand_over is not None:
                    hand_over.told = True  # (lost: sent again all the same, by the follow-up)
            elif hand_over is None:  # refused: the unit stays systemd's, with an older cpuset
                self._refused.append(cid)
            elif not hand_over.told:
                hand_over.told = True
                self._refused.append(hand_over.cid)
        return failed

    def forget(self, container_id: str) -> None:
        """The container's unit is given a cpuset by someone else now (the runtime, from a
        reply), or the container is gone: not bare any more, and not ours to hand over."""
        self._bare.pop(container_id, None)
        self._drop([u for u, h in self._open.items() if h.cid == container_id])

    def keep_only(self, container_ids: set[str]) -> None:
        for cid in self._bare.keys() - container_ids:
            del self._bare[cid]
        self._drop([u for u, h in self._open.items() if h.cid not in container_ids])

    def _drop(self, units: list[str]) -> None:
        for unit in units:
            hand_over = self._open[unit]
            if hand_over.calls:
                hand_over.dropped = True
            else:
                del self._open[unit]

    def take_refused(self) -> list[str]:
        """Containers whose call systemd refused after ``set_cpus`` had returned (answered
        late, or sent again): the runtime's to apply.  Each told once."""
        refused, self._refused = self._refused, []
        return refused

    def _changes(self, targets: list[cpusets.Target]) -> tuple[list[Item], list[str]]:
        """The calls to make, with the ids they are for, and the ids no call can serve."""
        changes: list[Item] = []
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
            if not asks_systemd(unit, self.root):  # never given one, or handed over
                self._bare[target.container_id] = unit
                continue
            self._unseen()
            changes.append((target.container_id, (unit, target.cpus, target.mems or None)))
        return changes, failed

    def _unseen(self) -> None:
        """A unit whose files cannot be read is taken as holding a cpuset (asked of systemd,
        then released): never as bare, which a ``daemon-reload`` would undo.  Said once when
        systemd's unit files are not to be seen at all."""
        if "unit-files" in self._said:
            return
        why = unseen(self.root)
        if why is not None:
            self._warn(
                "unit-files",
                f"systemd's unit files cannot be read ({why}): every systemd-driver "
                "container's scope is taken as holding a cpuset, and set then released through "
                "systemd at its first change; give the host's root as [systemd] unit_root "
                "(systemd.unit_root) to spare those calls for scopes that hold none",
            )

    def _lost(self, exclude: dict[str, str] | None = None) -> list[Item]:
        """The hand-overs to send again (each unit's cpuset of now), but those in ``exclude``."""
        skip = exclude or {}
        return [
            (h.cid, h.change)
            for unit, h in self._open.items()
            if h.lost and not h.dropped and unit not in skip
        ]

    def _settle_late(self) -> None:
        """The answers to calls left pending, in the order they came: a unit is bare once
        every call made for it is answered and its release confirmed; one lost is sent again
        (with its cpuset of now); one refused is the runtime's (the cgroup file written
        directly holds the cpuset meanwhile, but systemd would put the unit's older one back
        on its next re-apply)."""
        for result in self.client.take_late():
            self._note(result)
            unit = result.unit
            hand_over = self._open.get(unit)
            if hand_over is None:  # (a call made before the unit was confirmed bare, or dropped)
                if not result.ok:
                    self._forget_unit(unit)
                continue
            hand_over.calls = max(hand_over.calls - 1, 0)
            if hand_over.dropped:
                if hand_over.calls == 0:
                    del self._open[unit]
                continue
            if result.outcome in LOST:
                hand_over.lost = True
            elif result.outcome == su.GONE:
                del self._open[unit]
                continue
            elif not result.ok:
                self._warn(
                    f"late-{result.outcome}",
                    f"systemd refused a cpuset after the daemon had moved on ({result.error}); "
                    "the runtime applies it with its next reply",
                )
                if hand_over.calls == 0:
                    del self._open[unit]
                    self._forget_unit(unit)
                    self._refused.append(hand_over.cid)
                continue
            if hand_over.calls == 0 and result.outcome == su.SET:
                self._settled(unit, hand_over)

    def _note(self, result: UnitResult) -> None:
        if result.outcome == su.UNREACHABLE and getattr(result.error, "code", "") == "closed":
            self._broke = True

    def _follow_up(self) -> None:
        """While a hand-over is unfinished (calls unanswered, or lost), look again later,
        off the request path: soon, then less and less often."""
        if not any((h.lost and not h.dropped) or h.calls for h in self._open.values()):
            self._tries = 0
            return
        if self._waking or self.wake is None:
            return
        delay = FOLLOW_UP[min(self._tries, len(FOLLOW_UP) - 1)]
        self._tries += 1
        self._waking = self.wake(delay)

    def _forget_unit(self, unit: str) -> None:
        for cid in [cid for cid, bare in self._bare.items() if bare == unit]:
            del self._bare[cid]

    def _warn(self, outcome: str, message: str) -> None:
        """One warning per kind of failure: a systemd that cannot be reached fails every unit
        of every change, and the runtime applies them meanwhile (as without this writer)."""
        if outcome in self._said:
            return
        self._said.add(outcome)
        if not outcome.startswith(("late-", "release-", "unit-files")):
            message = f"cpusets of systemd-driver containers are left to the runtime: {message}"
        self.audit.record("systemd", message, audit_mod.WARNING, reason=outcome)

    def close(self) -> None:
        self.client.close()
