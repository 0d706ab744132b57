"""What bench_guest.py runs *in* the guest node (through ``Guest.call``): pod starts timed call
by call through CRI as kubelet's systemd driver makes them, the window read from the kernel,
and the runtime's runc calls counted (runc_calls.py).  Kept apart from bench_guest.py, whose
imports (the host side of the harness) the guest does not need."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from guest.scenarios import FIRST_LINE, _first_line
from harness.cri import ContainerSpec
from harness.guest_kubelet import CGROUP_ROOT, QOS_SLICES, SystemdKubelet, pod_slice, slice_path
from harness.k8s import BURSTABLE, PodSpec

from bench import runc_calls, shared_window


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
    """One 1-CPU Guaranteed pod: RunPodSandbox, CreateContainer and StartContainer timed; right
    after StartContainer returned, the shared containers on its CPU looked for until none is
    (``pinned``: the daemon runs; without it one look, which finds them all); its first line
    read (where it was born); then the pod removed.  The runtime's ``runc update`` calls are
    counted by target: from RunPodSandbox to the first line (*start*), during the removal, and
    from ``since`` (the previous sample's end) to this one (*between*: the daemon's restart)."""
    spec = ContainerSpec.guaranteed("app", 1, command=FIRST_LINE)
    pod = PodSpec.for_containers(f"bench-g-{label}", [spec])
    with SystemdKubelet(address) as cri:
        shared, roles = _shared(cri)
        before = runc_calls.log_size(runc_log)
        t0 = time.monotonic()
        pod_id = cri.run_pod(pod)
        t1 = time.monotonic()
        cid = cri.create_container(pod_id, spec)
        t2 = time.monotonic()
        cri.start(cid)
        t3 = time.monotonic()
        scope = CGROUP_ROOT / slice_path(pod_slice(pod)).lstrip("/") / f"cri-containerd-{cid}.scope"
        cpus = shared_window.exclusive_cpus(scope)
        if pinned:
            window = shared_window.measure(shared, cpus, since=t3)
        else:
            window = {"on_cpu_first": len(shared_window.on_cpus(shared, cpus)), "window_s": None}
        first = _first_line(cri, cid)
        started = runc_calls.log_size(runc_log)
        cri.stop(cid, timeout=0)
        cri.remove(cid)
        cri.stop_pod(pod_id)
        cri.remove_pod(pod_id)
        removed = runc_calls.log_size(runc_log)
    roles.update({cid: "guaranteed", pod_id: "guaranteed-sandbox"})
    return {
        "run_pod_s": t1 - t0,
        "create_s": t2 - t1,
        "start_s": t3 - t2,
        "pod_start_s": t3 - t0,
        "first_line": first,
        "cpus": sorted(cpus),
        "shared": len(shared),
        **window,
        "updates_start": _updates(runc_log, before, started, roles),
        "updates_removal": _updates(runc_log, started, removed, roles),
        "updates_between": _updates(runc_log, since, before, roles),
        "log_end": removed,
    }


def _updates(log: str, start: int, end: int, roles: dict[str, str]) -> dict[str, int]:
    return runc_calls.updates_by_target(runc_calls.calls(log, start, end), roles)
