"""One hook run under the state lock: steps 3 and 4 of runner.py's docstring.

Observe (the state as stored, then as the live cgroups say it must be: the stopped container
released, the ended ones too, the rest synchronized, in-place resizes found), decide
(``Engine.create``), **commit**, and only then write cgroupfs as one transaction, tell systemd,
keep interrupts off kept-free CPUs, repair cgroup v1's evictions and drop stale records; the
audit trail once the lock is released.  Each step boundary is a fault point (runner.py
``FAULT_STEPS``) that tests kill the process at.
"""

from __future__ import annotations

import os
from types import MappingProxyType

from ..base.value import Value
from ..core.cpuset import CPUSet
from ..core.engine import Engine
from ..core.events import WARNING
from ..core.outcome import Loaded, Outcome
from ..core.policy import PolicyError
from ..core.reconcile import LiveContainer
from ..core.state import NodeState
from ..core.workload import Workload, millicores_from_shares
from ..hardware import cgroupfs
from ..hardware.cgroupfs import CgroupError, CgroupFS, ContainerCgroups
from ..ops.audit import Audit
from ..ops.config import Settings
from ..storage.loading import load_state
from ..storage.store import StateStore
from . import containers, units
from .apply import apply_targets
from .failure import EXIT_OK, EXIT_REFUSED, HookFailure
from .records import Record, Records
from .topology_cache import remove_stale_writes

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:  # nic, cpusets and the interrupt keeper are imported when they are needed
    from collections.abc import Mapping

    from ..core.events import AuditEvent
    from ..core.state import IrqRecord
    from ..hardware.nic import Locality

IRQBALANCE_ENV = "/../run/nri-cpuplugin/irqbalance.env"  # ours: a ban to lift (irqbalance.py)

_NONE: Mapping = MappingProxyType({})


class View(Value):
    """What one run found under the lock, before deciding anything."""

    stored: NodeState | None  # the document as read (before following/normalising)
    loaded: Loaded
    records: dict[str, Record]
    unusable: dict[str, str]  # record files that could not be read, and why
    live: list[LiveContainer]
    requested: dict[str, CPUSet]  # cpuset.cpus of each live container's cgroup
    observed: Outcome  # the stop, the ended containers and the synchronize, in that order
    # cgroup v1: live containers whose cpuset the kernel emptied (a CPU went offline), their
    # processes moved to an ancestor; they are put back once the cpuset has CPUs again.
    evicted: frozenset[str] = frozenset()
    # Records of containers resized in place since the last run (to rewrite).
    resized: Mapping[str, Record] = _NONE


class Placing(Value):
    """The container a ``createRuntime`` run places."""

    workload: Workload
    cgroups: ContainerCgroups
    locality: Locality | None


class Committed(Value):
    """What the commit step leaves for the writes and the audit trail."""

    targets: dict[str, Record]  # every live container's record, the placed one included
    durable: bool  # False: the state could not be written (the cgroups are written anyway)
    unsaved: str  # why the state, or a resized container's record, could not be written


class LockedRun:
    """The locked part of one run; made by ``Hook`` with what it holds."""

    def __init__(
        self,
        settings: Settings,
        audit: Audit,
        store: StateStore,
        records: Records,
        proc: str = "/proc",
        fault: str | None = None,
    ) -> None:
        self.settings = settings
        self.proc = proc  # (tests: a generated /proc)
        self.fault = fault  # the step boundary to die at (runner.py FAULT_STEPS), tests only
        self.audit = audit
        self.store = store
        self.records = records

    def run(
        self,
        engine: Engine,
        fs: CgroupFS,
        placing: Placing | None = None,
        released_id: str | None = None,
    ) -> int:
        """Steps 3 and 4 of the module docstring under the state lock, then the audit trail."""
        store = self.store
        workload = placing.workload if placing is not None else None
        with store.locked():
            dir_fd = store.held_dir()
            self._fault("locked")
            view = self._observe(engine, fs, dir_fd, workload, released_id)
            outcome, refusal = self._decide(engine, view.observed, placing)
            placed = placing if outcome.decision is not None else None
            self._fault("decided")
            committed = self._commit(fs, dir_fd, view, outcome, placed)
            self._fault("committed")
            grown = self._grow_ancestors(fs, engine, view)
            writes, unkept = self._write(fs, engine, dir_fd, view, outcome.state, committed, placed)
            irq_events = self._keep_irqs_free(engine, outcome.state)
            returned, errors = self._return_evicted(fs, view, committed.targets)
            self._forget_records(dir_fd, view, outcome.state, committed.targets)
            self._fault("cleaned")
            lock_wait = store.lock_wait

        extra = {"lock_wait_ms": f"{lock_wait * 1000:.1f}", "cgroup_writes": len(writes)}
        self.audit.emit(view.loaded.events)
        self._report_unsaved(committed)
        self.audit.emit(outcome.events, **extra)
        self._report_repairs(returned, grown + errors)
        self._report_unkept(unkept)
        self.audit.emit(irq_events)
        if refusal is not None and workload is not None:
            raise HookFailure(
                str(refusal),
                EXIT_REFUSED,
                "refuse",
                lock_wait_ms=extra["lock_wait_ms"],
                **workload.identity(),
            )
        return EXIT_OK

    def _decide(
        self, engine: Engine, observed: Outcome, placing: Placing | None
    ) -> tuple[Outcome, PolicyError | None]:
        """The new container's decision after what was observed, or the policy's refusal."""
        if placing is None:
            return observed, None
        locality = placing.locality
        try:
            created = engine.create(
                observed.state,
                placing.workload,
                locality.preference if locality is not None else None,
                locality.note if locality is not None else None,
            )
        except PolicyError as err:
            return observed, err
        return observed.then(created), None

    def _commit(
        self,
        fs: CgroupFS,
        dir_fd: int,
        view: View,
        outcome: Outcome,
        placed: Placing | None,
    ) -> Committed:
        """Commit, then act.  The record of a newly placed container is written first, so
        every container a committed state names can be found again.  Records of resized
        containers go after the commit: until the state says so, the old record (its old
        request) is what makes the next run find the resize again."""
        records = {**view.records, **view.resized}
        targets = {c.workload.container_id: records[c.workload.container_id] for c in view.live}
        state = outcome.state
        try:
            if placed is not None:
                cid = placed.workload.container_id
                cgroups = placed.cgroups
                targets[cid] = Record(placed.workload, cgroups, containers.shares(fs, cgroups.cpu))
                self.records.write(dir_fd, targets[cid])
                self._fault("recorded")
            if view.loaded.set_aside:
                self.store.set_aside()
            if view.stored is None or state != view.stored:
                self.store.commit(state)  # (a followed online set: its new fingerprint too)
        except OSError as err:
            # A full disk must not stop containers that only share: where they run is
            # derived again by the next run.  Exclusive CPUs a crash could forget are not
            # handed out.
            if placed is not None and outcome.decision is not None and outcome.decision.exclusive:
                self.records.remove(dir_fd, [placed.workload.container_id])
                raise
            return Committed(targets, durable=False, unsaved=str(err))
        return Committed(targets, durable=True, unsaved=self._write_resized(dir_fd, view))

    def _write(
        self,
        fs: CgroupFS,
        engine: Engine,
        dir_fd: int,
        view: View,
        state: NodeState,
        committed: Committed,
        placed: Placing | None,
    ) -> tuple[list[str], list[str]]:
        """The cgroup writes of the committed state, then the systemd units' properties of
        those that are scopes (hook/units.py): (one line per write, one per unit systemd did
        not take).  When the writes fail (every write undone), a new placement is withdrawn
        from the state again."""
        try:
            held = view.loaded.state.assignments
            written, plan = apply_targets(
                fs,
                engine,
                state,
                committed.targets,
                view.requested,
                placed.workload if placed is not None else None,
                self._fault,
                was_exclusive={cid for cid, a in held.items() if a.cpus},
            )
        except CgroupError as err:
            if placed is not None and committed.durable and state != view.observed.state:
                # Every write was undone: the state must not claim the decision either.
                self.store.commit(view.observed.state)
                self.records.remove(dir_fd, [placed.workload.container_id])
            raise HookFailure(str(err)) from None
        changes, exclusive = units.scope_changes(fs, plan)
        new = placed.cgroups.cpuset.rsplit("/", 1)[-1] if placed is not None else ""
        s = self.settings
        told = units.tell_systemd(changes, s.systemd_bus, s.unit_files_root, exclusive, new)
        return written, told

    def _forget_records(
        self, dir_fd: int, view: View, state: NodeState, targets: Mapping[str, Record]
    ) -> None:
        """Records of containers the state no longer names go last: until the commit, the
        old state still named them."""
        keep = set(state.assignments) | set(state.sharing) | targets.keys()
        self.records.remove(dir_fd, sorted((view.records.keys() | view.unusable.keys()) - keep))

    def _keep_irqs_free(self, engine: Engine, state: NodeState) -> tuple[AuditEvent, ...]:
        """Interrupts in line with the committed state (hardware/interrupts/keeper.py), when
        anything is to do."""
        held = state.irqs or any(a.irq_free for a in state.assignments.values())
        if not held and not os.path.exists(self.proc + IRQBALANCE_ENV):
            return ()
        from ..hardware.interrupts import keeper as irq_keeper

        def record(records: Mapping[int, IrqRecord]) -> None:
            nonlocal state
            if dict(records) != dict(state.irqs):
                state = state.evolve(irqs=records)
                self.store.commit(state)

        roots = irq_keeper.Roots.beside(self.settings.sysfs, self.proc)
        online = engine.topology.online
        # A record that cannot be saved leaves the interrupts alone, not the container: it
        # keeps its CPUs, and the next hook run narrows them once the disk has room.
        retried = "by the next container's hook"
        return irq_keeper.keep_free(roots, state, online, frozenset(), record, retried).events

    def _report_unkept(self, unkept: list[str]) -> None:
        if unkept:
            self.audit.record(
                "systemd",
                "cpusets written to cgroups that systemd may put back (it did not take them as "
                f"the units' properties): {'; '.join(unkept)}",
                WARNING,
                reason="systemd",
            )

    def _report_unsaved(self, committed: Committed) -> None:
        unsaved = committed.unsaved
        if not committed.durable:
            self.audit.record(
                "state-unsaved",
                f"the state could not be written; the cgroups were written anyway: {unsaved}",
                WARNING,
                reason=unsaved,
            )
        elif unsaved:
            self.audit.record(
                "state-unsaved",
                f"the record of a container resized in place could not be written: {unsaved}; "
                "the next run finds the resize again",
                WARNING,
                reason=unsaved,
            )

    def _observe(
        self,
        engine: Engine,
        fs: CgroupFS,
        dir_fd: int,
        workload: Workload | None,
        released_id: str | None,
    ) -> View:
        """The state as stored, then as the live cgroups say it must be: the container the
        runtime says stopped is released, every other one whose cgroup is gone or empty too,
        and the rest synchronized as after an NRI Synchronize.  A state that had to be set
        aside is rebuilt from the records of containers still running."""
        stored, loaded = load_state(self.store, engine, announce=False)
        self._fault("loaded")
        records, unusable = self.records.load(dir_fd)
        remove_stale_writes(dir_fd)
        for problem in unusable.values():
            self.audit.record("reconcile", problem, WARNING)
        base = loaded.state
        known = set(base.assignments) | set(base.sharing) if loaded.trusted else set(records)
        observed = Outcome(base)
        pods = set()
        if released_id is not None:
            containers.check_stopped(fs, released_id, records.get(released_id))
            observed = engine.stop(base, released_id)
            known.discard(released_id)
            held = base.assignments.get(released_id)
            if held is not None:  # its restart may come next: keep what it held for that
                pods.add(held.pod_uid)
        live, requested, stale, evicted = containers.live(fs, known, records)
        if stale:
            observed = observed.then(
                engine.ended(observed.state, stale, "its cgroup is gone or empty")
            )
        pods |= {c.workload.pod_uid for c in live}
        if workload is not None:
            pods.add(workload.pod_uid)
        observed = observed.then(engine.synchronize(observed.state, live, pods))
        observed, resized = self._resized(engine, fs, observed, live, records)
        return View(
            stored,
            loaded,
            records,
            unusable,
            live,
            requested,
            observed,
            frozenset(evicted),
            resized,
        )

    def _write_resized(self, dir_fd: int, view: View) -> str:
        """Rewrite the records of containers resized in place, once the state says so; why
        that failed, if it did (the next run then finds the resize again, already made)."""
        try:
            for record in view.resized.values():
                self.records.write(dir_fd, record)
        except OSError as err:
            return str(err)
        return ""

    def _resized(
        self,
        engine: Engine,
        fs: CgroupFS,
        observed: Outcome,
        live: list[LiveContainer],
        records: Mapping[str, Record],
    ) -> tuple[Outcome, dict[str, Record]]:
        """In-place resizes since the last run: ``runc update`` runs no hook, so the CPU
        request in each live container's cgroup is compared with its record.  A change is
        resized as the daemon would (core/resize.py); growth that cannot be met keeps the
        container where it is, said in the audit trail.  Returns the records to rewrite."""
        changed: dict[str, Record] = {}
        for container in live:
            record = records[container.workload.container_id]
            shares = containers.shares(fs, record.cgroups.cpu)
            if shares is None or record.shares is None or shares == record.shares:
                continue
            request = millicores_from_shares(shares)
            # kubelet keeps a Guaranteed container's limit equal to its request.
            limit = request if record.workload.cpu_limit_milli is not None else None
            workload = record.workload.evolve(cpu_request_milli=request, cpu_limit_milli=limit)
            try:
                observed = observed.then(engine.resize(observed.state, workload))
            except PolicyError as err:
                self.audit.emit([engine.refused(workload, err)])
                continue
            changed[workload.container_id] = record.evolve(workload=workload, shares=shares)
        return observed, changed

    # --- cgroup v1 repairs -------------------------------------------------------------------

    def _grow_ancestors(self, fs: CgroupFS, engine: Engine, view: View) -> list[str]:
        """cgroup v1 after a change of the online CPUs: give the online CPUs back to the
        ancestors of every recorded container (the kernel never does), so the writes below and
        later ones may use CPUs that came back."""
        if view.loaded.followed is None or fs.layout.version != cgroupfs.V1:
            return []
        from ..hardware import cpusets

        paths = sorted({r.cgroups.cpuset for r in view.records.values()})
        return cpusets.grow_ancestors(fs.layout, paths, engine.topology.online)

    def _return_evicted(
        self, fs: CgroupFS, view: View, targets: Mapping[str, Record]
    ) -> tuple[dict[str, int], list[str]]:
        """cgroup v1: put processes the kernel evicted back into their container's cpuset,
        now that it has CPUs again (after a change of the online set, or when one was found
        evicted).  Failures are reported, not fatal: the cpusets are written already."""
        returned: dict[str, int] = {}
        errors: list[str] = []
        if fs.layout.version != cgroupfs.V1:
            return returned, errors
        cids = set(view.evicted) | (set(targets) if view.loaded.followed is not None else set())
        if not cids:
            return returned, errors
        from ..hardware import cpusets

        for cid in sorted(cids & targets.keys()):
            try:
                moved = cpusets.return_evicted_tasks(fs, targets[cid].cgroups.cpuset, self.proc)
            except CgroupError as err:
                errors.append(f"{cid[:12]}: {err}")
                continue
            if moved:
                returned[cid] = moved
        return returned, errors

    def _report_repairs(self, returned: dict[str, int], errors: list[str]) -> None:
        if not returned and not errors:
            return  # nearly every run: no need to import cpusets
        from ..hardware.cpusets import repair_events

        self.audit.emit(repair_events(returned, errors))

    def _fault(self, step: str) -> None:
        if self.fault == step:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
