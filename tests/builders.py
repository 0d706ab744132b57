"""What tests build: workloads as the policy sees them, NRI messages as the runtime sends them
for kubelet's pods, the events the NRI adapter makes of them, and the nodes the daemon runs on
(generated sysfs trees).  The one place for these: test modules import from here, never from
one another.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from sysfs_gen import MachineSpec, write_sysfs
from topologies import build

from nri_cpuplugin.core.workload import GUARANTEED, Workload, from_nri
from nri_cpuplugin.daemon import events as ev
from nri_cpuplugin.daemon.adapter import netns_of, pod_of
from nri_cpuplugin.nri.pb import nri_pb2 as pb
from nri_cpuplugin.ops.config import Settings

# --- workloads ----------------------------------------------------------------------------------

_ids = itertools.count()
_SAME = object()  # a Guaranteed workload's limit is its request (kubelet's rule)


def workload(
    milli: int = 1000,
    qos: str = GUARANTEED,
    *,
    name: str | None = None,
    pod: str | None = None,
    cid: str | None = None,
    limit: int | object | None = _SAME,
    kind: str = "app",
    cgroup_path: str | None = None,
    **annotations: str,
) -> Workload:
    """A container as the policy sees it.  A named one is the same container at each call
    (its id ``<name>-id``: a resize, say) unless ``cid`` says otherwise (a restart); an
    unnamed one is a new container each time.  ``name`` defaults its pod (``<name>-pod``, else
    "pod-a") and its cgroup (``/kubepods/<name>``).  The limit is the request for Guaranteed,
    none otherwise, unless given."""
    n = next(_ids)
    if limit is _SAME:
        limit = milli if qos == GUARANTEED else None
    assert limit is None or isinstance(limit, int)
    uid = pod or (f"{name}-pod" if name else "pod-a")
    return Workload(
        container_id=cid or (f"{name}-id" if name else f"{n:064x}"),
        container_name=name or f"c{n}",
        pod_uid=uid,
        pod_name=pod or name or uid,
        pod_namespace="ns",
        qos=qos,
        cpu_request_milli=milli,
        cpu_limit_milli=limit,
        annotations=annotations,
        kind=kind,
        cgroup_path=(f"/kubepods/{name}" if name else "") if cgroup_path is None else cgroup_path,
    )


# --- NRI messages -------------------------------------------------------------------------------


def pod(name: str, qos: str = "guaranteed") -> pb.PodSandbox:
    """A pod's sandbox as the runtime sends it (its cgroup parent by QoS class)."""
    parent = {
        "guaranteed": f"/kubepods/pod{name}",
        "burstable": f"/kubepods/burstable/pod{name}",
        "besteffort": f"/kubepods/besteffort/pod{name}",
    }[qos]
    sandbox = pb.PodSandbox(id=f"sb-{name}", name=name, uid=f"uid-{name}", namespace="ns")
    sandbox.linux.cgroup_parent = parent
    return sandbox


def guaranteed_pod(name: str, milli: int) -> pb.PodSandbox:
    """A Guaranteed pod whose sandbox carries its CPU limit of ``milli`` (kubelet sends the
    sum over its containers; NRI passes it on as ``pod_resources``)."""
    sandbox = pod(name)
    cpu = sandbox.linux.pod_resources.cpu
    cpu.shares.value = milli * 1024 // 1000
    cpu.period.value, cpu.quota.value = 100000, milli * 100
    return sandbox


def container(
    name: str, sandbox: pb.PodSandbox, milli: int, state: int = 3, cpus: str = ""
) -> pb.Container:
    """A container of ``sandbox`` asking for ``milli`` CPU (its id: ``name`` padded to 64)."""
    c = pb.Container(id=f"{name:0<64}", pod_sandbox_id=sandbox.id, name=name, state=state)
    c.linux.resources.cpu.shares.value = max(2, milli * 1024 // 1000)
    c.linux.resources.cpu.period.value = 100000
    c.linux.resources.cpu.quota.value = milli * 100
    c.linux.resources.cpu.cpus = cpus
    return c


def creation(sandbox: pb.PodSandbox, ctr: pb.Container) -> ev.CreateContainer:
    """The event the NRI adapter makes of a CreateContainer (daemon/adapter.py)."""
    return ev.CreateContainer(from_nri(sandbox, ctr), pod_of(sandbox), netns_of(sandbox))


# --- nodes --------------------------------------------------------------------------------------


def node_settings(tmp_path: Path, budget: float = 1.5, state: str = "state") -> Settings:
    """The generated 48-CPU node (CPUs 0 and 24 reserved; a tree of its own at each call), its
    state in ``tmp_path/<state>``, each request's budget ``budget`` seconds (the product's
    default: what a busy machine takes never runs it out)."""
    root, _ = build("xeon-e5-2680v3-2s", tmp_path)
    return Settings(
        sysfs=str(root),
        state_dir=str(tmp_path / state),
        reserved_cpu_count=2,
        nri_request_budget=budget,
    )


HOTPLUG_SPEC = MachineSpec(name="hotplug-8", sockets=2, cores_per_socket=4, threads_per_core=1)


class Machine:
    """A sysfs root that is a symlink, so a test can swap the whole tree as hotplug would (8
    CPUs on 2 sockets, ``HOTPLUG_SPEC``)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.root = tmp_path / "sysfs"
        self.n = 0

    def set(self, offline: set[int] = frozenset()) -> None:
        self.n += 1
        tree = write_sysfs(
            MachineSpec(**{**HOTPLUG_SPEC.__dict__, "offline": frozenset(offline)}),
            self.tmp / f"tree-{self.n}",
        )
        tmp_link = self.tmp / "sysfs.new"
        os.symlink(tree, tmp_link)
        os.replace(tmp_link, self.root)
