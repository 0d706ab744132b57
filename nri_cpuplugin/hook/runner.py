"""One OCI hook run: ``createRuntime`` places a container, ``poststop`` releases it.

The decisions are the engine's (core/engine.py), exactly as in the NRI daemon; this module
turns one hook invocation into engine events and the outcome into cgroup writes:

1. read and check the input (state JSON, ``<bundle>/config.json``, ``/proc/<pid>/cgroup``);
   pause containers and containers without a Kubernetes identity are left alone;
2. take the state lock (storage/lock.py), waiting a bounded time well below the hook timeout;
3. observe: load the state, then release the container the runtime says stopped and every
   recorded container whose cgroup is gone or empty (``poststop`` only runs when the runtime
   deletes a container, often long after it died), and synchronize with what still runs;
4. decide (``Engine.create``), **commit**, and only then write cgroupfs: the container's cpuset
   (+ NUMA nodes, CFS quota lifted when exclusive) and every shared container's cpuset, as one
   transaction that is undone if any write fails.

This module takes steps 1 and 2 (and NIC locality, read before the lock); locked_run.py the rest.
The hook finds shared containers again through its records (records.py).  A node's containers are
placed either by the hook or by the NRI daemon, not both: an assignment the hook has no record for
cannot be checked and is treated as stale.

Test-only: ``NRI_CPUPLUGIN_FAULT=<step>`` makes the process SIGKILL itself at that step boundary
(see FAULT_STEPS) so tests can prove that the next run repairs whatever was left half done.
Nothing sets it in production; the runtime passes hooks exactly the ``env`` of their hook entry.
"""

from __future__ import annotations

import os

from ..base.files import FileError
from ..base.value import Value
from ..core.engine import Engine
from ..core.events import DEBUG, NOTICE, WARNING
from ..core.policy import PolicyError, StaticPolicy
from ..core.workload import Workload
from ..hardware import cgroupfs
from ..hardware.cgroupfs import CgroupError, CgroupFS
from ..hardware.nic_guard import candidate_locality, netns_path
from ..ops.audit import Audit
from ..ops.config import Settings
from ..storage import owner
from ..storage.store import StateStore
from . import containers, oci
from .failure import EXIT_OK, EXIT_REFUSED, HookFailure
from .locked_run import LockedRun, Placing
from .records import Records
from .topology_cache import cached_topology

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost)
if TYPE_CHECKING:  # nic and cpusets are imported when they are needed
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
# The hooks.d entries give the hook 30 s (hooks/*.json).  A commit takes milliseconds, so
# waiting 10 s means hundreds of hooks are queued; past that, failing with a clear message
# beats being SIGKILLed by the runtime with none.
DEFAULT_LOCK_TIMEOUT = 10.0


class Options(Value):
    stage: str | None = None  # from argv; None = from the state's status
    cgroup_root: str = cgroupfs.DEFAULT_ROOT
    proc: str = "/proc"
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    fault: str | None = None


class Hook:
    def __init__(self, settings: Settings, options: Options, audit: Audit) -> None:
        self.settings = settings
        self.options = options
        self.audit = audit
        self.store = StateStore(settings.state_dir, options.lock_timeout, use_alarm=True)
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
        if self._deferred(state):
            return EXIT_OK
        if state.pid is None:
            raise oci.InputError(
                f"the state of container {state.id} has no pid: placing a container needs its "
                "process (is the hook configured for a stage other than createRuntime?)"
            )
        layout = self._layout()
        cgroups = cgroupfs.read_proc_cgroup(state.pid, layout, self.options.proc)
        containers.check_container_cgroup(cgroups.cpuset, state.id, state.pid)
        workload = oci.from_oci(state, config, cgroups.cpuset, identity)
        engine = self._engine()
        locality = self._nic_locality(engine.policy, workload, config)
        with CgroupFS(layout) as fs:
            if not fs.exists("cpuset", cgroups.cpuset):
                raise CgroupError(f"cgroup {cgroups.cpuset} of container {state.id} is gone")
            return self._run().run(engine, fs, placing=Placing(workload, cgroups, locality))

    def release(self, state: oci.OCIState) -> int:
        if self._deferred(state):
            return EXIT_OK
        engine = self._engine()
        with CgroupFS(self._layout()) as fs:
            return self._run().run(engine, fs, released_id=state.id)

    def _run(self) -> LockedRun:
        options = self.options
        return LockedRun(
            self.settings, self.audit, self.store, self.records, options.proc, options.fault
        )

    # --- hardware awareness -----------------------------------------------------------------

    def _nic_locality(
        self, policy: StaticPolicy, workload: Workload, config: oci.OCIConfig
    ) -> Locality | None:
        """Where the pod's NICs are (nic.py), for exclusive candidates only, before the lock
        as in the daemon (nic is imported only for these).  Bad annotations and a strict
        locality that cannot be inspected are refusals."""
        try:
            return candidate_locality(
                workload, netns_path(config.namespaces), self.settings.sysfs, policy.topology
            )
        except PolicyError as err:
            raise HookFailure(str(err), EXIT_REFUSED, "refuse", **workload.identity()) from None

    # --- helpers ---------------------------------------------------------------------------

    def _engine(self) -> Engine:
        s = self.settings
        dir_fd = self.store.open_dir()
        try:
            topology = cached_topology(s.sysfs, s.state_dir, dir_fd)
        finally:
            os.close(dir_fd)
        return s.engine(topology)

    def _layout(self) -> cgroupfs.Layout:
        return cgroupfs.detect(self.options.cgroup_root)

    def _deferred(self, state: oci.OCIState) -> bool:
        """Whether an NRI daemon owns this state directory, in which case this run changes
        nothing (storage/owner.py: the daemon wins).  A live daemon has placed the container
        through NRI already; while a daemon that placed containers here is down, placing
        from the hook could give away CPUs its containers hold, so the container runs
        unpinned - as on a daemon-only node - until the daemon is back and resynchronizes."""
        try:
            dir_fd = self.store.open_dir(create=False)  # a probe creates nothing
        except FileError as err:
            if err.code == "missing":
                return False  # no state directory yet: no daemon ever claimed it
            raise
        try:
            claim = owner.probe(dir_fd, self.settings.state_dir)
        finally:
            os.close(dir_fd)
        if claim is None:
            return False
        daemon = f"the NRI daemon (pid {claim.pid})" if claim.pid else "an NRI daemon"
        where = os.path.join(self.settings.state_dir, owner.DAEMON_FILE)
        if claim.running:
            message = (
                f"container {state.id[:12]} left to {daemon}, which owns "
                f"{self.settings.state_dir}: the OCI hook and the NRI daemon are both "
                "installed on this node; remove the hooks.d files"
            )
        else:
            message = (
                f"container {state.id[:12]} not placed: {daemon}, which owns "
                f"{self.settings.state_dir}, is not running; placing it here could give away "
                f"CPUs its containers hold. Start the daemon again, or, to use the hook "
                f"instead, stop the daemon for good and remove {where}"
            )
        self.audit.record(
            "defer",
            message,
            NOTICE if claim.running else WARNING,
            container_id=state.id,
            daemon_pid=claim.pid,
            daemon_running=claim.running,
        )
        return True

    def _skip(self, state: oci.OCIState, why: str) -> None:
        self.audit.record(
            "skip", f"container {state.id[:12]} left alone: {why}", DEBUG, container_id=state.id
        )
