"""StartContainer in the daemon (a part of CPUPlugin kept apart for size).  The runtime sends
it after it made the container's cgroup and before the container's first instruction, and
waits for the answer (containerd 1.7-2.3 create the task - ``runc create`` - first; CRI-O
likewise): the last moment at which the container's cgroup can be set right before anything of
it runs.  Three things happen there: the state a creation held is committed, a shared
container created from a pool that moved meanwhile is written, and - with
``[nri] pin_at = "start"`` - the container is decided in the first place.

Pinning at start: the runtime does not consult the daemon when it creates a container.  Every
plugin subscribed to CreateContainer costs that call the runtime's own side of an NRI round
trip (5-12 % on the project's test machine for a plugin that does nothing), more than the
creation of an earmarked exclusive container costs us otherwise; not consulted, the runtime's
CreateContainer costs what it costs without any plugin.  What it gives up
(docs/architecture.md, "Pinning at start"): the container's stored spec names no cpuset until
a reply can carry one (its next UpdateContainer, or Synchronize), and its cgroup is written
directly - so only the cgroupfs cgroup driver is served: under the systemd driver, systemd
would take a unit's cpuset back on daemon-reload.  Such a container is refused with what to
do."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.engine import Target
from ..core.policy import PolicyError, describe
from ..core.workload import from_nri
from ..hardware import cpusets
from ..nri.pb import nri_pb2 as pb
from ..ops import audit as audit_mod
from .targets import cpus_of, is_cgroupfs_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Starts:
    """Mixed into CPUPlugin, whose settings, state, engine, audit, cgroups and creation path
    it uses (declared here for the reader; CPUPlugin defines them)."""

    settings: Any
    state: Any
    engine: Any
    audit: Any
    liveness: Any
    _owed: set[str]
    _unbalanced: set[str]
    _cpusets: Any

    def start_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        """The runtime has created the container's cgroup from its stored spec; its first
        instruction has not run yet.  A shared container whose CreateContainer was answered
        just before another container's exclusive allocation was created with the old pool,
        and no write could reach it then (it had no cgroup yet; the runtime may even have
        taken the update into its spec after the cgroup was made from the old one): its cgroup
        is read, and written if it says anything else, so it never runs on the exclusive CPUs.
        One read for every other container.

        A shared container's cgroup is also made quick to write here (``_prepare_shared``),
        where that costs its own start, not a later exclusive creation.  And the state its
        creation decided is committed here (``_hold``).

        With ``[nri] pin_at = "start"`` the runtime did not ask us when it created the
        container, so it is decided here first (``_create_at_start``); its cgroup, made from
        its pod's, is then written like that of a container the pool moved away from."""
        if self._decides_at_start(container.id):
            self._create_at_start(pod, container)
        self._write_held()
        [*targets] = self.engine.update(self.state, container.id).targets
        if not targets:
            return
        if container.id in self.state.sharing:
            self._prepare_shared(container.id)
        live = self.liveness.cpus(self.state.cgroups.get(container.id, ""))
        created = cpus_of(container) if live is None else live
        if self.settings.nri_pin_at == "start":
            if created != targets[0].cpus or targets[0].exclusive:
                self._write_at_start(pod, container, targets[0])
        elif created != targets[0].cpus:
            self.audit.record(
                "share",
                f"{pod.namespace}/{pod.name}/{container.name} was created with CPUs "
                f"{created or 'unknown'}; the shared pool moved meanwhile: starting it "
                f"on {targets[0].cpus}",
                audit_mod.INFO,
                container_id=container.id,
                cpus=targets[0].cpus,
                reason="pool moved during creation",
            )
            # What cannot be written (systemd driver) goes with the next reply that can carry it.
            self._owed |= {t.container_id for t in self._write_followers(targets)}

    def _decides_at_start(self, cid: str) -> bool:
        """Whether this StartContainer is the container's decision: pinning at start, and a
        container the daemon has not placed yet (one listed by Synchronize was placed then)."""
        return (
            self.settings.nri_pin_at == "start"
            and cid not in self.state.assignments
            and cid not in self.state.sharing
        )

    def _create_at_start(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        """Decide the container as a creation (shared containers written, state held for the
        commit that follows); what only the runtime can move is owed to its next reply."""
        path = container.linux.cgroups_path
        if not is_cgroupfs_path(path):
            which = f"the systemd cgroup driver's path {path!r}" if path else "no cgroup path"
            workload = from_nri(pod, container)
            err = PolicyError(
                f'{describe(workload)} has {which}, but [nri] pin_at = "start" writes each '
                "container's cgroup directly, which only the cgroupfs driver allows (systemd "
                'would undo it): set pin_at = "create" (the default) in the plugin\'s '
                "configuration, or run the runtime with the cgroupfs driver",
                "config",
            )
            self.audit.emit([self.engine.refused(workload, err)])
            raise err
        _, updates = self._decide_creation(pod, container, _no_reply)  # type: ignore[attr-defined]
        self._owed |= {update.container_id for update in updates}

    def _warn_unserved_driver(self, containers: Iterable[pb.Container]) -> None:
        """At Synchronize: pinning at start on a node whose containers use the systemd cgroup
        driver refuses every start; said once per connection, before the first refusal."""
        if self.settings.nri_pin_at != "start":
            return
        unserved = [c for c in containers if not is_cgroupfs_path(c.linux.cgroups_path)]
        if unserved:
            self.audit.record(
                "config",
                f'[nri] pin_at = "start" serves the cgroupfs cgroup driver only, but '
                f"{len(unserved)} of the runtime's containers have other cgroup paths (like "
                f"{unserved[0].linux.cgroups_path!r}): new containers like them will be "
                'refused at their start; set pin_at = "create" (the default)',
                audit_mod.ERR,
                reason="pin_at start needs cgroupfs",
            )

    def _write_at_start(self, pod: pb.PodSandbox, container: pb.Container, target: Target) -> None:
        """Write the container's own cgroup (cpuset, and an exclusive one's memory nodes and
        quota); refused when it cannot be, rather than started on its pod's CPUs."""
        write = self._cgroup_target(target)  # type: ignore[attr-defined]
        layout = self.liveness.layout()
        if layout is None:
            errors = ["no cgroup filesystem found"]
        else:
            errors = cpusets.move(layout, [write], self._unbalanced, self._cpusets).errors
        if errors:
            raise PolicyError(
                f"the CPUs {target.cpus} decided for {describe(from_nri(pod, container))} "
                f"could not be written to its cgroup {write.runtime_path!r} "
                f"({'; '.join(errors)}): it is not started now, and kubelet retries it",
                "cgroup-write",
            )


def _no_reply(reply: object) -> bool:
    # The decision's reply is StartContainer's own, once the container's cgroup is written.
    return True
