"""What bench_guest.py runs *in* the guest node (through ``Guest.call``): pod starts timed call
by call through CRI as kubelet's systemd driver makes them.  Kept apart from bench_guest.py,
whose imports (the host side of the harness) the guest does not need."""

from __future__ import annotations

import time
from typing import Any

from guest.scenarios import FIRST_LINE, _first_line
from harness.cri import ContainerSpec
from harness.guest_kubelet import SystemdKubelet


def start_shared(address: str, count: int) -> list[str]:
    """``count`` running Burstable pods (the shared containers a Guaranteed start moves)."""
    with SystemdKubelet(address) as cri:
        return [
            cri.run(f"bench-shared-{i}", [ContainerSpec("app", cpu_request_milli=100)]).id
            for i in range(count)
        ]


def timed_guaranteed_start(address: str, label: str) -> dict[str, Any]:
    """One 1-CPU Guaranteed pod: RunPodSandbox, CreateContainer and StartContainer timed, its
    first line read (where it was born), then the pod removed."""
    from harness.k8s import PodSpec

    spec = ContainerSpec.guaranteed("app", 1, command=FIRST_LINE)
    pod = PodSpec.for_containers(f"bench-g-{label}", [spec])
    with SystemdKubelet(address) as cri:
        t0 = time.monotonic()
        pod_id = cri.run_pod(pod)
        t1 = time.monotonic()
        cid = cri.create_container(pod_id, spec)
        t2 = time.monotonic()
        cri.start(cid)
        t3 = time.monotonic()
        first = _first_line(cri, cid)
        cri.stop(cid, timeout=0)
        cri.remove(cid)
        cri.stop_pod(pod_id)
        cri.remove_pod(pod_id)
    return {
        "run_pod_s": t1 - t0,
        "create_s": t2 - t1,
        "start_s": t3 - t2,
        "pod_start_s": t3 - t0,
        "first_line": first,
    }
