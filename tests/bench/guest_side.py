"""What bench_guest.py runs *in* the guest node (through ``Guest.call``): pod starts timed call
by call through CRI as kubelet's systemd driver makes them, the window read from the kernel,
and the runtime's runc calls counted (runc_calls.py).  Kept apart from bench_guest.py, whose
imports (the host side of the harness) the guest does not need."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from guest.scenarios import FIRST_LINE, _first_line
from harness.cri import ContainerSpec
from harness.guest_kubelet import CGROUP_ROOT, QOS_SLICES, SystemdKubelet, pod_slice, slice_path
from harness.k8s import BURSTABLE, PodSpec

from bench import start_sample


def start_shared(address: str, count: int, first: int = 0) -> list[str]:
    """``count`` running Burstable pods (the shared containers a Guaranteed start moves),
    numbered from ``first`` (pod names must not repeat)."""
    with SystemdKubelet(address) as cri:
        return [
            cri.run(f"bench-shared-{i}", [ContainerSpec("app", cpu_request_milli=100)]).id
            for i in range(first, first + count)
        ]


def _shared(cri: SystemdKubelet) -> tuple[dict[str, Path], dict[str, str]]:
    """The running shared containers' scopes (id -> directory) and every container's role for
    the runc count (the shared pods' sandboxes apart)."""
    burstable = CGROUP_ROOT / slice_path(QOS_SLICES[BURSTABLE]).lstrip("/")
    scopes = {
        d.name.removeprefix("cri-containerd-").removesuffix(".scope"): d
        for d in burstable.glob("*/cri-containerd-*.scope")
    }
    roles = {pod.id: "shared-sandbox" for pod in cri.pods()}
    shared = {}
    for c in cri.containers(state="CONTAINER_RUNNING"):
        roles[c.id] = "shared"
        if c.id in scopes:
            shared[c.id] = scopes[c.id]
    return shared, roles


def timed_guaranteed_start(
    address: str, label: str, pinned: bool, runc_log: str, since: int = 0
) -> dict[str, Any]:
    """One 1-CPU Guaranteed pod started, timed and removed (start_sample.py says how)."""
    spec = ContainerSpec.guaranteed("app", 1, command=FIRST_LINE)
    pod = PodSpec.for_containers(f"bench-g-{label}", [spec])
    pod_dir = CGROUP_ROOT / slice_path(pod_slice(pod)).lstrip("/")
    with SystemdKubelet(address) as cri:
        shared, roles = _shared(cri)
        return start_sample.timed_start(
            cri,
            pod,
            spec,
            shared=shared,
            roles=roles,
            pinned=pinned,
            runc_log=runc_log,
            since=since,
            own_cpuset=lambda cid: pod_dir / f"cri-containerd-{cid}.scope",
            first_line=lambda cid: _first_line(cri, cid),
        )
