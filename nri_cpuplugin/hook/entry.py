"""The OCI runtime hook: ``createRuntime`` places a container, ``poststop`` releases it.

CRI-O and podman (through runc or crun) run this program once per container event with the
container's state JSON on stdin (docs/oci-hooks-and-cgroups.md §2).  It makes the decisions the
NRI plugin makes, through the same policy and the same state file under the same lock, and
applies them by writing cgroupfs itself:

1. read and check the input (state JSON, ``<bundle>/config.json``, ``/proc/<pid>/cgroup``);
   pause containers and containers without a Kubernetes identity are left alone;
2. take the state lock, waiting a bounded time well below the hook timeout;
3. load the state and reconcile it with the live cgroups: ``poststop`` only runs when the
   runtime deletes a container, often long after it died, so every run drops what is gone;
4. decide (``StaticPolicy.admit`` / ``release``), **commit**, and only then write cgroupfs: the
   container's cpuset (+ NUMA nodes, CFS quota lifted when exclusive) and every shared
   container's cpuset, as one transaction that is undone if any write fails.

How shared containers are found again: the state document only names containers.  For each
container it places, the hook keeps a small record ``<state_dir>/hook-containers/<id>.json``
(its cgroup paths and the Workload fields the policy reads), written before the state commit
that names the container and removed after the commit that forgets it.  The live cgroups say
whether a recorded container still runs; the record says where its cgroup is and, if the state
file is lost, lets the state be rebuilt from what runs (``reconcile``).  A node's containers
are placed either by the hook or by the NRI daemon, not both: an assignment the hook has no
record for cannot be checked and is treated as stale.

Test-only: ``NRI_CPUPLUGIN_FAULT=<step>`` makes the process SIGKILL itself at that step boundary
(see FAULT_STEPS) so tests can prove that the next run repairs whatever was left half done.
Nothing sets it in production; the runtime passes hooks exactly the ``env`` of their hook entry.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from collections.abc import Iterator, Mapping

from ..base import jsonbytes
from ..base.value import Value
from ..core.cpuset import CPUSet
from ..core.policy import (
    EXCLUSIVE_ANNOTATION,
    ISOLATED_ANNOTATION,
    Decision,
    Followed,
    PolicyError,
    StaticPolicy,
)
from ..core.reconcile import LiveContainer, reconcile
from ..core.state import NodeState
from ..core.topology import Topology, TopologyError, discover
from ..core.workload import Workload
from ..hardware import cgroupfs
from ..hardware.cgroupfs import CgroupError, CgroupFS, ContainerCgroups, Transaction
from ..ops.audit import DEBUG, ERR, WARNING, Audit
from ..ops.config import ConfigError, Settings, base_settings, flag_overrides, merge
from ..storage.store import Expected, StateLockTimeout, StateStore
from . import oci

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:  # nic and hotplug are imported when they are needed (see _nic_locality)
    from typing import Any, BinaryIO, TextIO

    from ..hardware.nic import Locality

FAULT_ENV = "NRI_CPUPLUGIN_FAULT"
FAULT_STEPS = (
    "locked",  # the state lock is held
    "loaded",  # state read (and rebuilt if it had to be)
    "decided",  # stale entries released, the new decision made, nothing written yet
    "recorded",  # the container's record is written
    "committed",  # the new state is on disk
    "shared-written",  # the shared containers' cpusets are written
    "container-written",  # the container's own cpuset (and quota) are written
    "cleaned",  # records of released containers are removed
)
RECORDS_DIR = "hook-containers"
TOPOLOGY_CACHE = "hook-topology.json"
MAX_TOPOLOGY_BYTES = 4 << 20  # ~120 bytes per CPU
RECORD_VERSION = 1
# The hooks.d entries give the hook 30 s (hooks/*.json).  A commit takes milliseconds, so
# waiting 10 s means hundreds of hooks are queued; past that, failing with a clear message
# beats being SIGKILLed by the runtime with none.
DEFAULT_LOCK_TIMEOUT = 10.0
CFS_PERIOD_US = 100_000  # kubelet's period: a degraded container's quota is count * this

ALLOCATE, RELEASE = "allocate", "release"
STAGES = {
    "createRuntime": ALLOCATE,
    "create-runtime": ALLOCATE,
    "prestart": ALLOCATE,
    "poststop": RELEASE,
}
# runc reports "creating" in createRuntime/prestart, crun "created"; both say "stopped" in
# poststop.
STATUSES = {"creating": ALLOCATE, "created": ALLOCATE, "stopped": RELEASE}

EXIT_OK, EXIT_REFUSED, EXIT_INPUT = 0, 1, 2


class HookFailure(Exception):
    """Ends the run with a one-line reason on stderr and a non-zero exit."""

    def __init__(
        self,
        message: str,
        code: int = EXIT_REFUSED,
        action: str = "hook-failed",
        **fields: object,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.action = action
        self.fields = fields


class Options(Value):
    stage: str | None = None  # from argv; None = from the state's status
    cgroup_root: str = cgroupfs.DEFAULT_ROOT
    proc: str = "/proc"
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    fault: str | None = None


# --- the state lock, without filelock ------------------------------------------------------


class HookStore(StateStore):
    """The daemon's StateStore with the same lock taken directly: ``flock(2)`` LOCK_EX on
    ``state.lock``, which is exactly what filelock's UnixFileLock holds, so daemon, CLI and
    hooks exclude each other.  Importing filelock costs ~90 ms (it pulls asyncio, ssl and
    sqlite3), more than everything else the hook does.

    The wait blocks in flock(2) - so the next waiter runs the moment the lock is free - and a
    one-shot SIGALRM bounds it.  ``lock_wait`` is how long the last acquisition waited."""

    def __init__(self, state_dir: str, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        super().__init__(state_dir, lock_timeout)
        self._fd: int | None = None
        self.lock_wait = 0.0

    def holds_lock(self) -> bool:
        return self._fd is not None

    @contextlib.contextmanager
    def locked(self, timeout: float | None = None) -> Iterator[StateStore]:
        if self._fd is not None:
            yield self
            return
        wait = self.lock_timeout if timeout is None else timeout
        self._ensure_dir()
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.lock_path, flags, 0o600)
        try:
            started = time.monotonic()
            if not _try_flock(fd):
                _wait_flock(fd, wait, self.lock_path)
            self.lock_wait = time.monotonic() - started
            self._fd = fd
            try:
                yield self
            finally:
                self._fd = None
        finally:
            os.close(fd)  # the last descriptor of the open file: releases the lock


class _Expired(Exception):
    pass


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _wait_flock(fd: int, wait: float, lock_path: object) -> None:
    # Imported only when the lock is busy: most runs never wait.
    import signal
    import threading

    if wait > 0 and threading.current_thread() is threading.main_thread():
        waiting = [True]

        def expire(signum: int, frame: object) -> None:
            if waiting[0]:
                raise _Expired

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, wait)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            waiting[0] = False
            return
        except _Expired:
            # The alarm may have hit just after flock returned: then we hold the lock.
            if _try_flock(fd):
                return
        finally:
            waiting[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    else:  # signals only reach the main thread: poll (in-process callers on other threads)
        deadline = time.monotonic() + max(wait, 0.0)
        delay = 0.001
        while time.monotonic() < deadline:
            time.sleep(delay)
            if _try_flock(fd):
                return
            delay = min(delay * 2, 0.02)
    raise StateLockTimeout(
        f"timed out after {wait:g}s waiting for the state lock {lock_path}: another "
        "nri-cpuplugin process (daemon, hook or CLI) holds it; `fuser -v "
        f"{lock_path}` shows who"
    )


# --- records: where each placed container's cgroups are ------------------------------------


class Record(Value):
    workload: Workload
    cgroups: ContainerCgroups


class _View(Value):
    """What one run found under the lock, before deciding anything."""

    loaded: NodeState | None  # the stored state, if it could be trusted
    rebuilt: str | None  # why the stored state was set aside, if it was
    base: NodeState  # loaded, or an empty state to rebuild on
    records: dict[str, Record]
    unusable: dict[str, str]  # record files that could not be read, and why
    live: list[LiveContainer]
    requested: dict[str, CPUSet]  # cpuset.cpus of each live container's cgroup
    stale: list[tuple[str, Decision | None]]  # released because their cgroup is gone/empty
    released: Decision | None  # the container the runtime says stopped (poststop)
    repaired: NodeState  # base with all of the above applied
    notes: tuple[str, ...]
    # The online CPUs changed since the state was committed: (stored fingerprint, what
    # following the new online set did).  None when they did not.
    followed: tuple[str, Followed] | None = None
    # cgroup v1: live containers whose cpuset the kernel emptied (a CPU went offline), their
    # processes moved to an ancestor; they are put back once the cpuset has CPUs again.
    evicted: frozenset[str] = frozenset()


class _Repairs(Value):
    """cgroup v1 hotplug repairs of one run: processes put back, and what failed."""

    returned: dict[str, int]
    errors: list[str]


class Records:
    """``<state_dir>/hook-containers/<container id>.json``: one small file per placed container.

    Written by rename (a reader sees a whole file or none) and only under the state lock.  No
    fsync: the page cache survives the death of a hook process, and a machine crash that loses
    a record also kills the container it describes."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, RECORDS_DIR)

    def load(self) -> tuple[dict[str, Record], dict[str, str]]:
        """(records by container id, {container id: why its file is unusable})."""
        records: dict[str, Record] = {}
        problems: dict[str, str] = {}
        try:
            entries = os.listdir(self.dir)
        except FileNotFoundError:
            return records, problems
        for name in entries:
            cid = name.removesuffix(".json")
            if not name.endswith(".json") or not oci.CONTAINER_ID.fullmatch(cid):
                continue  # our temp files and anything else are not records
            try:
                records[cid] = self._read(cid)
            except (OSError, ValueError, TypeError, KeyError, CgroupError) as err:
                problems[cid] = f"record {name} is unusable and is removed: {err}"
        return records, problems

    def _read(self, cid: str) -> Record:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(os.path.join(self.dir, f"{cid}.json"), flags)
        try:
            data = os.read(fd, oci.MAX_STATE_BYTES + 1)
        finally:
            os.close(fd)
        doc = jsonbytes.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("version") != RECORD_VERSION or doc.get("container_id") != cid:
            raise ValueError("not a record of this version for this container")
        names = ("container_name", "pod_uid", "pod_name", "pod_namespace", "qos", "kind")
        if not all(isinstance(doc.get(key), str) for key in names):
            raise TypeError(f"{', '.join(names)} must be strings")
        request, limit = doc.get("cpu_request_milli"), doc.get("cpu_limit_milli")
        if type(request) is not int or not (limit is None or type(limit) is int):
            raise TypeError("cpu_request_milli / cpu_limit_milli must be integers")
        cpuset = doc.get("cpuset_cgroup")
        cpu = doc.get("cpu_cgroup")
        cgroupfs.split_path(cpuset)
        if cpu is not None:
            cgroupfs.split_path(cpu)
        workload = Workload(
            container_id=cid,
            container_name=doc["container_name"],
            pod_uid=doc["pod_uid"],
            pod_name=doc["pod_name"],
            pod_namespace=doc["pod_namespace"],
            qos=doc["qos"],
            cpu_request_milli=request,
            cpu_limit_milli=limit,
            annotations=oci.string_map(doc.get("annotations"), "annotations"),
            kind=doc["kind"],
            cgroup_path=cpuset,
        )
        return Record(workload, ContainerCgroups(cpuset, cpu))

    def write(self, record: Record) -> None:
        w = record.workload
        doc = {
            "version": RECORD_VERSION,
            "container_id": w.container_id,
            "cpuset_cgroup": record.cgroups.cpuset,
            "cpu_cgroup": record.cgroups.cpu,
            "container_name": w.container_name,
            "pod_uid": w.pod_uid,
            "pod_name": w.pod_name,
            "pod_namespace": w.pod_namespace,
            "qos": w.qos,
            "cpu_request_milli": w.cpu_request_milli,
            "cpu_limit_milli": w.cpu_limit_milli,
            # Only what the policy reads: pods carry kilobytes of unrelated annotations.
            "annotations": _policy_annotations(w.annotations),
            "kind": w.kind,
        }
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        final = os.path.join(self.dir, f"{w.container_id}.json")
        tmp = os.path.join(self.dir, f".{w.container_id}.tmp")
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            os.write(fd, jsonbytes.dumps(doc))
        finally:
            os.close(fd)
        os.replace(tmp, final)

    def remove(self, cid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, f"{cid}.json"))


def _policy_annotations(annotations: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in annotations.items()
        if k.startswith((EXCLUSIVE_ANNOTATION, ISOLATED_ANNOTATION))
    }


# --- one run ---------------------------------------------------------------------------------


class Hook:
    def __init__(self, settings: Settings, options: Options, audit: Audit) -> None:
        self.settings = settings
        self.options = options
        self.audit = audit
        self.store = HookStore(settings.state_dir, options.lock_timeout)
        self.records = Records(settings.state_dir)

    # --- entry points ----------------------------------------------------------------------

    def allocate(self, state: oci.OCIState) -> int:
        config = oci.read_config(state.bundle)
        annotations = config.annotations
        if oci.is_sandbox(annotations):
            self._skip(state, "pod sandbox (pause) container")
            return EXIT_OK
        identity = oci.kubernetes_identity(annotations)
        if identity is None:
            self._skip(state, "no Kubernetes pod uid and container name annotations")
            return EXIT_OK
        if state.pid is None:
            raise oci.InputError(
                f"the state of container {state.id} has no pid: placing a container needs its "
                "process (is the hook configured for a stage other than createRuntime?)"
            )
        layout = self._layout()
        cgroups = cgroupfs.read_proc_cgroup(state.pid, layout, self.options.proc)
        _check_container_cgroup(cgroups.cpuset, state.id, state.pid)
        workload = oci.from_oci(state, config, cgroups.cpuset, identity)
        policy = self._policy()
        locality = self._nic_locality(policy, workload, config)
        with CgroupFS(layout) as fs:
            if not fs.exists("cpuset", cgroups.cpuset):
                raise CgroupError(f"cgroup {cgroups.cpuset} of container {state.id} is gone")
            return self._locked_run(
                policy, fs, workload=workload, cgroups=cgroups, locality=locality
            )

    def release(self, state: oci.OCIState) -> int:
        policy = self._policy()
        with CgroupFS(self._layout()) as fs:
            return self._locked_run(policy, fs, released_id=state.id)

    # --- the locked part -------------------------------------------------------------------

    def _locked_run(
        self,
        policy: StaticPolicy,
        fs: CgroupFS,
        workload: Workload | None = None,
        cgroups: ContainerCgroups | None = None,
        released_id: str | None = None,
        locality: Locality | None = None,
    ) -> int:
        store = self.store
        with store.locked():
            self._fault("locked")
            view = self._observe(policy, fs, workload, released_id)
            decision: Decision | None = None
            refusal: PolicyError | None = None
            state = view.repaired
            if workload is not None:
                try:
                    preference = locality.preference if locality is not None else None
                    decision, state = policy.admit(view.repaired, workload, preference)
                except PolicyError as err:
                    refusal = err
            self._fault("decided")

            # Commit, then act.  The record of a newly placed container is written first, so
            # every container a committed state names can be found again.
            targets = {
                c.workload.container_id: view.records[c.workload.container_id] for c in view.live
            }
            if decision is not None:
                targets[workload.container_id] = Record(workload, cgroups)
                self.records.write(targets[workload.container_id])
                self._fault("recorded")
            if view.loaded is None or state != view.loaded or view.followed is not None:
                store.commit(state)  # (a followed online set: its new fingerprint too)
            self._fault("committed")
            grown = self._grow_ancestors(fs, policy, view)
            try:
                writes = self._apply(fs, policy, state, targets, view.requested, workload)
            except CgroupError as err:
                if decision is not None and state != view.repaired:
                    # Every write was undone: the state must not claim the decision either.
                    store.commit(view.repaired)
                    self.records.remove(workload.container_id)
                raise HookFailure(str(err)) from None
            repairs = self._return_evicted(fs, view, targets)
            repairs.errors[:0] = grown

            # Records of containers the state no longer names go last: until the commit above,
            # the old state still named them.
            keep = _known(state) | targets.keys()
            for cid in (view.records.keys() | view.unusable.keys()) - keep:
                self.records.remove(cid)
            self._fault("cleaned")
            lock_wait = store.lock_wait

        self._report(view, decision, workload, released_id, state, writes, lock_wait)
        self._report_hardware(view, repairs, decision, workload, locality)
        if refusal is not None:
            raise HookFailure(
                str(refusal),
                EXIT_REFUSED,
                "refuse",
                lock_wait_ms=f"{lock_wait * 1000:.1f}",
                **workload.identity(),
            )
        return EXIT_OK

    def _observe(
        self,
        policy: StaticPolicy,
        fs: CgroupFS,
        workload: Workload | None,
        released_id: str | None,
    ) -> _View:
        """The state as stored, then as the live cgroups say it must be: the container the
        runtime says stopped is released, every other one whose cgroup is gone or empty too
        (as stale), and the rest reconciled as after an NRI Synchronize.  A state that had to
        be set aside is rebuilt from the records of containers still running."""
        loaded, rebuilt, followed = self._load(policy)
        self._fault("loaded")
        records, unusable = self.records.load()
        for problem in unusable.values():
            self.audit.record("reconcile", problem, WARNING)
        known = set(records) if loaded is None else _known(loaded)
        base = loaded or policy.empty_state()
        state = base
        released: Decision | None = None
        pods = set()
        if released_id is not None:
            released, state = policy.release(state, released_id)
            known.discard(released_id)
            held = base.assignments.get(released_id)
            if held is not None:  # its restart may come next: keep what it held for that
                pods.add(held.pod_uid)
        live, requested, stale_ids, evicted = self._live(fs, known, records)
        stale = []
        for cid in stale_ids:
            gone, state = policy.release(state, cid)
            stale.append((cid, gone))
        pods |= {c.workload.pod_uid for c in live}
        if workload is not None:
            pods.add(workload.pod_uid)
        result = reconcile(policy, state, live, pods)
        return _View(
            loaded,
            rebuilt,
            base,
            records,
            unusable,
            live,
            requested,
            stale,
            released,
            result.state,
            result.notes,
            followed,
            frozenset(evicted),
        )

    def _load(
        self, policy: StaticPolicy
    ) -> tuple[NodeState | None, str | None, tuple[str, Followed] | None]:
        """(trusted state or None, why it had to be rebuilt, (stored fingerprint, followed)
        when the online CPUs changed since the last commit) - as the daemon's load_state: any
        CPU layout is accepted, a changed online set is repaired in place, never set aside."""
        result = self.store.load(Expected(policy.name, None, policy.reserved))
        state, problem = result.state, result.problem
        followed = None
        if state is not None and state.fingerprint != policy.topology.fingerprint():
            followed = (state.fingerprint, policy.follow_online(state))
            state = followed[1].state
        if state is not None:
            problem = policy.check(state)
            if problem is not None:
                self.store.set_aside()
                state = None
        if state is None:
            quarantined = result.quarantined is not None or problem != result.problem
            return None, problem if quarantined else None, None
        return policy.normalized(state), None, followed

    def _live(
        self, fs: CgroupFS, known: Any, records: Mapping[str, Record]
    ) -> tuple[list[LiveContainer], dict[str, CPUSet], list[str], set[str]]:
        """(known containers that still run - their recorded cgroup has processes - with the
        CPUs they run on; the cpusets their cgroups ask for; the stale rest; the evicted ones).
        The two sets differ only on cgroup v2, when an ancestor does not offer every CPU asked
        for.  Evicted (cgroup v1): the kernel emptied the cpuset when its last CPU went offline
        and moved the processes up; the cpu controller's cgroup still holds them."""
        live, requested, stale, evicted = [], {}, [], set()
        for cid in sorted(known):
            record = records.get(cid)
            try:
                if record is not None and fs.populated(record.cgroups.cpuset):
                    path = record.cgroups.cpuset
                    running_on = fs.cpus(path)
                    live.append(LiveContainer(record.workload, running_on))
                    v2 = fs.layout.version == cgroupfs.V2
                    requested[cid] = fs.requested(path) if v2 else running_on
                    continue
                if record is not None and _evicted(fs, record):
                    live.append(LiveContainer(record.workload, CPUSet()))
                    requested[cid] = CPUSet()
                    evicted.add(cid)
                    continue
            except CgroupError:
                pass  # its cgroup is gone (ENOENT) or unreadable: it cannot be running there
            stale.append(cid)
        return live, requested, stale, evicted

    def _apply(
        self,
        fs: CgroupFS,
        policy: StaticPolicy,
        state: NodeState,
        targets: Mapping[str, Record],
        requested: Mapping[str, CPUSet],
        current: Workload | None,
    ) -> list[str]:
        """Bring every live container's cgroups in line with ``state``: CPUs taken away first,
        then CPUs given, the new container last.  One transaction: all or nothing.  Returns
        one line per cgroup written."""
        unlimited = self.settings.cfs_quota == "unlimited"
        plan: list[tuple[str, Record, CPUSet, CPUSet | None, int | None]] = []
        for cid, record in targets.items():
            held = state.assignments.get(cid)
            if held is None and cid not in state.sharing:
                continue
            # Exclusive CPUs, or the shared pool (shared containers, and degraded exclusive
            # ones that lost every CPU they held to hotplug).
            cpus = policy.cpuset_for(state, cid)
            if held is not None and held.cpus:
                quota = -1 if unlimited else None  # lifted
                plan.append((cid, record, cpus, policy.topology.numa_of(cpus), quota))
            elif held is not None:
                # Degraded into the shared pool: its CPU limit bounds it again meanwhile.
                quota = held.count * CFS_PERIOD_US if unlimited else None
                plan.append((cid, record, cpus, None, quota))
            elif requested.get(cid) != cpus:
                # (Shared containers already on the pool, the usual case, need no write.)
                plan.append((cid, record, cpus, None, None))
        current_id = current.container_id if current is not None else None
        others = [p for p in plan if p[0] != current_id]
        mine = [p for p in plan if p[0] == current_id]
        # CPUs are taken away before they are given, so no CPU is ever in more places than
        # it already was.
        others.sort(key=lambda p: (not (requested.get(p[0], CPUSet()) - p[2]), p[0]))
        written: list[str] = []
        tx = Transaction(fs)
        for step in (others, mine):
            for cid, record, cpus, mems, quota in step:
                try:
                    if _place(tx, record, cpus, mems, quota):
                        written.append(f"{cid[:12]}={cpus}")
                except CgroupError as err:
                    # A sibling exiting right now must not fail this container (as the NRI
                    # path's ignore_failure); the next run finds it stale.
                    if cid != current_id and not _still_running(fs, record):
                        continue
                    undone = len(tx.done)
                    failed = tx.rollback()
                    message = f"{err}; rolled back {undone} earlier cgroup writes"
                    if failed:
                        message += f", {len(failed)} of which failed: {'; '.join(failed)}"
                    raise CgroupError(message) from None
            if step is others:
                self._fault("shared-written")
            elif current is not None:
                self._fault("container-written")
        return written

    # --- hardware awareness (issue 7) ------------------------------------------------------

    def _nic_locality(
        self, policy: StaticPolicy, workload: Workload, config: oci.OCIConfig
    ) -> Locality | None:
        """Where the pod's NICs are (nic.py), for exclusive candidates only, before the lock
        as in the daemon (nic is imported only for these).  Bad annotations and a strict
        locality that cannot be inspected are refusals."""
        try:
            if policy.eligibility(workload)[0] is None:
                return None
            from ..hardware import nic

            return nic.locality(
                nic.netns_path(config.namespaces),
                workload.annotations,
                workload.container_name,
                self.settings.sysfs,
                policy.topology,
            )
        except PolicyError as err:
            raise HookFailure(str(err), EXIT_REFUSED, "refuse", **workload.identity()) from None

    def _grow_ancestors(self, fs: CgroupFS, policy: StaticPolicy, view: _View) -> list[str]:
        """cgroup v1 after a change of the online CPUs: give the online CPUs back to the
        ancestors of every recorded container (the kernel never does), so the writes below and
        later ones may use CPUs that came back."""
        if view.followed is None or fs.layout.version != cgroupfs.V1:
            return []
        from ..hardware import hotplug

        paths = sorted({r.cgroups.cpuset for r in view.records.values()})
        return hotplug.grow_ancestors(fs.layout, paths, policy.topology.online)

    def _return_evicted(self, fs: CgroupFS, view: _View, targets: Mapping[str, Record]) -> _Repairs:
        """cgroup v1: put processes the kernel evicted back into their container's cpuset,
        now that it has CPUs again (after a change of the online set, or when one was found
        evicted).  Failures are reported, not fatal: the cpusets are written already."""
        repairs = _Repairs({}, [])
        if fs.layout.version != cgroupfs.V1:
            return repairs
        cids = set(view.evicted) | (set(targets) if view.followed is not None else set())
        if not cids:
            return repairs
        from ..hardware import hotplug

        for cid in sorted(cids & targets.keys()):
            try:
                moved = hotplug.return_evicted_tasks(
                    fs, targets[cid].cgroups.cpuset, self.options.proc
                )
            except CgroupError as err:
                repairs.errors.append(f"{cid[:12]}: {err}")
                continue
            if moved:
                repairs.returned[cid] = moved
        return repairs

    def _report_hardware(
        self,
        view: _View,
        repairs: _Repairs,
        decision: Decision | None,
        workload: Workload | None,
        locality: Locality | None,
    ) -> None:
        audit = self.audit
        if view.followed is not None and view.loaded is not None:
            from ..hardware import hotplug

            stored, followed = view.followed
            audit.record(
                "state-repair",
                f"the online CPUs changed since the last commit ({stored} -> "
                f"{followed.state.fingerprint}): assignments kept on CPUs still online, "
                f"{len(followed.changes)} containers changed",
                WARNING,
                reason="online set changed",
            )
            hotplug.audit_changes(audit, followed)
        for cid, moved in sorted(repairs.returned.items()):
            audit.record(
                "cgroup-repair",
                f"put {moved} processes of container {cid[:12]} back into its cpuset (cgroup "
                "v1 had moved them out when the cpuset lost its last CPU)",
                container_id=cid,
                processes=moved,
            )
        for error in repairs.errors:
            audit.record("cgroup-repair", f"cpuset repair failed: {error}", WARNING, reason=error)
        exclusive = decision is not None and decision.exclusive
        if exclusive and workload is not None and locality is not None:
            from ..hardware import nic  # loaded already: it produced ``locality``

            nic.audit_placement(audit, decision, workload, locality)

    # --- helpers ---------------------------------------------------------------------------

    def _policy(self) -> StaticPolicy:
        s = self.settings
        topology = cached_topology(s.sysfs, s.state_dir)
        return StaticPolicy.from_config(
            topology, s.reserved_cpus, s.effective_reserved_count, s.policy_options
        )

    def _layout(self) -> cgroupfs.Layout:
        return cgroupfs.detect(self.options.cgroup_root)

    def _fault(self, step: str) -> None:
        if self.options.fault == step:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    def _skip(self, state: oci.OCIState, why: str) -> None:
        self.audit.record(
            "skip", f"container {state.id[:12]} left alone: {why}", DEBUG, container_id=state.id
        )

    def _report(
        self,
        view: _View,
        decision: Decision | None,
        workload: Workload | None,
        released_id: str | None,
        state: NodeState,
        writes: list[str],
        lock_wait: float,
    ) -> None:
        audit = self.audit
        wait_ms = f"{lock_wait * 1000:.1f}"
        if view.rebuilt is not None:
            audit.record(
                "state-rebuild",
                f"state file set aside, rebuilt from live cgroups: {view.rebuilt}",
                WARNING,
                reason=view.rebuilt,
            )
        if view.released is not None and released_id is not None:
            audit.record(
                "release",
                f"released CPUs {view.released.cpus} of container {released_id[:12]}",
                container_id=released_id,
                cpus=view.released.cpus,
                shared_cpus=state.shared,
                lock_wait_ms=wait_ms,
            )
        for cid, gone in view.stale:
            cpus = f" (frees {gone.cpus})" if gone is not None else ""
            audit.record(
                "release",
                f"container {cid[:12]} no longer runs{cpus}: its cgroup is gone or empty",
                container_id=cid,
                cpus=gone.cpus if gone is not None else None,
                reason="stale",
            )
        for note in view.notes:
            audit.record("reconcile", note, reason="hook")
        if decision is not None and workload is not None:
            who = f"{workload.pod_namespace}/{workload.pod_name}/{workload.container_name}"
            fields = {
                "reason": decision.reason,
                "cpus": decision.cpus,
                "shared_cpus": state.shared,
                "lock_wait_ms": wait_ms,
                "cgroup_writes": len(writes),
                **workload.identity(),
            }
            if decision.exclusive:
                audit.record(
                    "allocate",
                    f"{who} got exclusive CPUs {decision.cpus} (NUMA {decision.mems}): "
                    f"{decision.reason}",
                    mems=decision.mems,
                    **fields,
                )
            else:
                audit.record(
                    "share",
                    f"{who} runs in the shared pool {decision.cpus}: {decision.reason}",
                    DEBUG,
                    **fields,
                )
        if view.base.shared != state.shared:
            audit.record(
                "shared-resize",
                f"shared pool {view.base.shared} -> {state.shared} ({len(state.sharing)} shared "
                f"containers; {len(writes)} cgroups written)",
                shared_cpus=state.shared,
                old_shared_cpus=view.base.shared,
            )


def cached_topology(sysfs: str, state_dir: str) -> Topology:
    """``topology.discover`` reads ~10 sysfs files per CPU: 60 ms on a 256-thread node, more
    than the rest of the hook.  Within one boot the layout only changes with the online,
    present or isolated sets, so the hook keeps the last result in the state directory, keyed
    by those (and the boot id and the sysfs tree itself), and discovers again when any differs.
    """
    key = _topology_key(sysfs)
    path = os.path.join(state_dir, TOPOLOGY_CACHE)
    if key is not None:
        try:
            with open(path, "rb") as f:
                doc = jsonbytes.loads(f.read(MAX_TOPOLOGY_BYTES))
            if isinstance(doc, dict) and doc.get("key") == key:
                return Topology.from_dict(doc.get("topology"))
        except (OSError, ValueError, TopologyError):
            pass  # missing, torn or foreign: discover afresh
    topology = discover(sysfs)
    if key is not None:
        with contextlib.suppress(OSError):
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600)
            try:
                os.write(fd, jsonbytes.dumps({"key": key, "topology": topology.as_dict()}))
            finally:
                os.close(fd)
            os.replace(tmp, path)
    return topology


def _topology_key(sysfs: str) -> dict[str, Any] | None:
    cpu_dir = os.path.join(sysfs, "devices/system/cpu")
    try:
        info = os.stat(cpu_dir)
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        lists = {}
        for name in ("online", "offline", "present", "isolated"):
            try:
                with open(os.path.join(cpu_dir, name)) as f:
                    lists[name] = f.read(4096).strip()
            except FileNotFoundError:
                lists[name] = None
    except OSError:
        return None  # no cache without a reliable key
    return {
        "sysfs": os.path.realpath(sysfs),
        "tree": [info.st_dev, info.st_ino, info.st_mtime_ns],
        "boot_id": boot_id,
        **lists,
    }


def _known(state: NodeState) -> set[str]:
    return set(state.assignments) | set(state.sharing)


def _place(
    tx: Transaction, record: Record, cpus: CPUSet, mems: CPUSet | None, quota: int | None
) -> bool:
    """Write the cpuset; ``quota``: None leaves CFS quota alone, -1 lifts it, else sets it."""
    changed = cgroupfs.set_cpuset(tx, record.cgroups.cpuset, cpus, mems)
    if quota is not None and record.cgroups.cpu is not None:
        if quota < 0:
            changed |= cgroupfs.lift_quota(tx, record.cgroups.cpu)
        else:
            changed |= cgroupfs.limit_quota(tx, record.cgroups.cpu, quota, CFS_PERIOD_US)
    return changed


def _evicted(fs: CgroupFS, record: Record) -> bool:
    """cgroup v1: the container's cpuset holds no process but its cpu cgroup does - the kernel
    moved its processes up when the cpuset lost its last CPU (see hotplug.py)."""
    if fs.layout.version != cgroupfs.V1 or record.cgroups.cpu is None:
        return False
    if not fs.exists("cpuset", record.cgroups.cpuset):
        return False
    return bool(fs.read("cpu", record.cgroups.cpu, "cgroup.procs"))


def _still_running(fs: CgroupFS, record: Record) -> bool:
    try:
        return fs.populated(record.cgroups.cpuset)
    except CgroupError:
        return False


def _check_container_cgroup(path: str, cid: str, pid: int) -> None:
    """The pid comes from the runtime: make sure we are about to write the container's own
    cgroup, not the root or a pod-wide one (runtimes name the container's cgroup after its id:
    ``crio-<id>``, ``<id>``, ``libpod-<id>``, crun's ``crio-<id>.scope/container``)."""
    parts = cgroupfs.split_path(path)
    if not parts:
        raise oci.InputError(f"process {pid} is in the root cgroup, not in a container's cgroup")
    if not any(cid in part for part in parts[-2:]):
        raise oci.InputError(
            f"the cgroup {path} of process {pid} is not named after container {cid}; refusing "
            "to write it (is pid the container's init process?)"
        )


# --- process entry ---------------------------------------------------------------------------


def action_for(stage: str | None, status: str) -> str:
    if stage is not None:
        try:
            return STAGES[stage]
        except KeyError:
            raise oci.InputError(
                f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}"
            ) from None
    try:
        return STATUSES[status]
    except KeyError:
        raise oci.InputError(
            f"cannot tell the hook stage from container status {status!r}; give it as an "
            "argument (createRuntime or poststop)"
        ) from None


def run(
    settings: Settings,
    options: Options,
    stdin: BinaryIO,
    stderr: TextIO,
    audit: Audit | None = None,
) -> int:
    """One hook invocation; returns the exit status.  Failures print one line on ``stderr``
    (the runtime shows it to whoever created the container) and leave an audit record."""
    audit = audit if audit is not None else Audit(SOURCE="oci-hook")
    cid = ""
    try:
        state = oci.read_state(stdin)
        cid = state.id
        hook = Hook(settings, options, audit)
        if action_for(options.stage, state.status) == ALLOCATE:
            return hook.allocate(state)
        return hook.release(state)
    except HookFailure as err:
        return _fail(stderr, audit, str(err), err.code, err.action, cid, **err.fields)
    except (oci.InputError, ConfigError, TopologyError) as err:
        return _fail(stderr, audit, str(err), EXIT_INPUT, "hook-input", cid)
    except PolicyError as err:  # configuration the policy cannot run with
        return _fail(stderr, audit, str(err), EXIT_INPUT, "hook-config", cid)
    except (CgroupError, StateLockTimeout) as err:
        return _fail(stderr, audit, str(err), EXIT_REFUSED, "hook-failed", cid)
    except OSError as err:
        return _fail(
            stderr, audit, f"{err.filename or ''}: {err.strerror or err}", 1, "hook-failed", cid
        )
    except Exception as err:  # a bug must still fail as one line, not a traceback
        return _fail(
            stderr, audit, f"internal error: {type(err).__name__}: {err}", 1, "hook-failed", cid
        )


def _fail(
    stderr: TextIO, audit: Audit, reason: str, code: int, action: str, cid: str, **fields: object
) -> int:
    line = " ".join(reason.split())  # exactly one line, whatever the message held
    fields.setdefault("container_id", cid or None)
    with contextlib.suppress(Exception):  # the reason on stderr matters more than the record
        audit.record(action, line, ERR, reason=line, **fields)
    stderr.write(f"nri-cpuplugin: {line}\n")
    stderr.flush()
    return code


USAGE = """\
usage: nri-cpuplugin-hook [--config FILE] [--state-dir DIR] [--reserved-cpus LIST]
                          [--sysfs ROOT] [--cgroup-root DIR] [--lock-timeout SECONDS] [STAGE]

Place (createRuntime) or release (poststop) the container whose OCI state JSON is on stdin,
writing cgroupfs directly.  Without STAGE it is read from the state's status (creating ->
createRuntime, stopped -> poststop).  Also run as `nri-cpuplugin hook`.

  STAGE                    createRuntime (also prestart) or poststop
  --config FILE            TOML configuration (the daemon's keys)
  --state-dir DIR          state directory (/var/lib/nri-cpuplugin)
  --reserved-cpus LIST     reserved CPUs, e.g. 0-1 (instead of the configured ones)
  --sysfs ROOT             sysfs root for the topology (/sys)
  --cgroup-root DIR        cgroup mount root (/sys/fs/cgroup; v1 or v2)
  --lock-timeout SECONDS   longest wait for the state lock (10; 0: fail at once when it
                           is held); keep it well below the hook's timeout
"""
# The hook parses its few options itself: argparse and the CLI's parser cost more start-up
# time than the rest of the hook's own code (docs/benchmarks.md, "OCI hook").
FLAGS = ("--config", "--state-dir", "--reserved-cpus", "--sysfs", "--cgroup-root", "--lock-timeout")


class UsageError(ValueError):
    """Bad command line; the message says which argument and what is accepted."""


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, str]] | None:
    """(STAGE or None, {flag name without dashes: value}); None for --help."""
    stage: str | None = None
    values: dict[str, str] = {}
    args = iter(argv)
    options = True
    for arg in args:
        if options and arg in ("-h", "--help"):
            return None
        if options and arg == "--":
            options = False  # what follows is the STAGE, even if it starts with "-"
        elif options and arg.startswith("-") and arg != "-":
            flag, has_value, value = arg.partition("=")
            if flag not in FLAGS:
                raise UsageError(f"unknown option {flag}; options: {', '.join(FLAGS)}")
            if not has_value:
                value = next(args, None)
                if value is None or value.startswith("--"):  # a forgotten value, not a file
                    raise UsageError(f"{flag} needs a value ({flag}=VALUE if it starts with -)")
            values[flag[2:]] = value
        elif stage is None:
            stage = arg
        else:
            raise UsageError(f"unexpected argument {arg!r}: only one STAGE is taken")
    return stage, values


def settings_and_options(
    stage: str | None, values: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[Settings, Options]:
    """Defaults, then the config file, then the flags (flags win)."""
    reserved = None
    if "reserved-cpus" in values:
        try:
            reserved = CPUSet.parse(values["reserved-cpus"])
        except ValueError as err:
            raise ConfigError(f"--reserved-cpus: {err}") from None
    flags = flag_overrides(
        state_dir=values.get("state-dir"), sysfs=values.get("sysfs"), reserved_cpus=reserved
    )
    lock_timeout = DEFAULT_LOCK_TIMEOUT
    if "lock-timeout" in values:
        try:
            lock_timeout = float(values["lock-timeout"])
        except ValueError:
            lock_timeout = -1.0
        if not 0 <= lock_timeout < float("inf"):
            raise ConfigError(
                f"--lock-timeout {values['lock-timeout']!r}: expected a number of seconds >= 0"
            )
    options = Options(
        stage=stage,
        cgroup_root=values.get("cgroup-root") or cgroupfs.DEFAULT_ROOT,
        lock_timeout=lock_timeout,
        fault=environ.get(FAULT_ENV) or None,
    )
    return merge(base_settings(values.get("config")), flags), options


def main(argv: list[str] | None = None) -> int:
    """``nri-cpuplugin-hook`` (and ``nri-cpuplugin hook``)."""
    jsonbytes.use_stdlib()  # a new process per container start: start-up time matters most
    try:
        parsed = parse_args(sys.argv[1:] if argv is None else argv)
        if parsed is None:
            sys.stdout.write(USAGE)
            return EXIT_OK
        settings, options = settings_and_options(*parsed, os.environ)
    except (UsageError, ConfigError) as err:
        return _fail(sys.stderr, Audit(SOURCE="oci-hook"), str(err), EXIT_INPUT, "hook-config", "")
    return run(settings, options, sys.stdin.buffer, sys.stderr)


def launch() -> None:
    """The entry of the launcher ``nri-cpuplugin install-hook`` writes (hook_launcher.py): ``main``,
    then exit without the interpreter's teardown (~3 ms of module and object cleanup): by then
    the state is committed and fsynced, the cgroups are written, the audit records are sent,
    and the standard streams are flushed here."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
