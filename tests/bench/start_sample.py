"""One timed Guaranteed pod start, the same on the host (bench_host_starts.py) and in the guest
node (guest_side.py, run by the guest's python3: only the harness's CRI client and stdlib).

RunPodSandbox, CreateContainer and StartContainer are timed call by call; right after
StartContainer returned, the shared containers on the new container's CPU are looked for until
none is (``pinned``: the daemon runs; without it one look, which finds them all); its first line
is read (where it was born); then the pod is removed.  The runtime's ``runc update`` calls are
counted by target: from RunPodSandbox to the first line (*start*), during the removal, and from
``since`` (the previous sample's end) to this one (*between*: the daemon's restart)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cri import CRIClient
from harness.k8s import ContainerSpec, PodSpec

from bench import runc_calls, shared_window


def timed_start(
    cri: CRIClient,
    pod: PodSpec,
    spec: ContainerSpec,
    *,
    shared: dict[str, Path],
    roles: dict[str, str],
    pinned: bool,
    runc_log: str | Path,
    since: int,
    own_cpuset: Callable[[str], Path],
    first_line: Callable[[str], str],
) -> dict[str, Any]:
    """``shared``: the running shared containers' cpuset directories; ``roles``: every known
    container's role for the runc count; ``own_cpuset``/``first_line``: how this node finds a
    container's cgroup and its first line."""
    before = runc_calls.log_size(runc_log)
    t0 = time.monotonic()
    pod_id = cri.run_pod(pod)
    t1 = time.monotonic()
    cid = cri.create_container(pod_id, spec)
    t2 = time.monotonic()
    cri.start(cid)
    t3 = time.monotonic()
    cpus = shared_window.exclusive_cpus(own_cpuset(cid))
    if pinned:
        window = shared_window.measure(shared, cpus, since=t3)
    else:
        window = {"on_cpu_first": len(shared_window.on_cpus(shared, cpus)), "window_s": None}
    first = first_line(cid)
    started = runc_calls.log_size(runc_log)
    cri.stop(cid, timeout=0)
    cri.remove(cid)
    cri.stop_pod(pod_id)
    cri.remove_pod(pod_id)
    removed = runc_calls.log_size(runc_log)
    roles = {**roles, cid: "guaranteed", pod_id: "guaranteed-sandbox"}

    def updates(start: int, end: int) -> dict[str, int]:
        return runc_calls.updates_by_target(runc_calls.calls(runc_log, start, end), roles)

    return {
        "run_pod_s": t1 - t0,
        "create_s": t2 - t1,
        "start_s": t3 - t2,
        "pod_start_s": t3 - t0,
        "first_line": first,
        "cpus": sorted(cpus),
        "shared": len(shared),
        **window,
        "updates_start": updates(before, started),
        "updates_removal": updates(started, removed),
        "updates_between": updates(since, before),
        "log_end": removed,
    }
