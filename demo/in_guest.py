"""The guest side of ``./dev demo --guest`` (demo/guest.py): pod steps run *in* the guest node
by ``Guest.call`` (tests/harness/guest_call.py), each a separate short process, so that the
host can print progress between them.

Pods are started and removed through CRI as kubelet's systemd driver does it
(tests/harness/guest_kubelet.py: the pod's slice first, then RunPodSandbox with the slice as
cgroup parent).  What a container is shown with is what its first process and systemd say:
``Cpus_allowed_list`` / ``Mems_allowed_list`` from ``/proc/<pid>/status``, and the scope's
``AllowedCPUs`` / ``AllowedMemoryNodes``.  Nothing here judges; the results go back as JSON.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from harness.cri import ContainerSpec
from harness.guest_kubelet import CGROUP_ROOT, SystemdKubelet, pod_slice, stop_slice, unit_property
from harness.host import parse_cpu_list

# The container's own first view, before anything could move it: its first log lines.
FIRST_LINES = "grep -E 'Cpus_allowed_list|Mems_allowed_list' /proc/self/status; exec sleep infinity"


def start_pod(
    address: str, name: str, cpus: int = 0, milli: int = 0, watch: dict[str, str] | None = None
) -> dict[str, Any]:
    """A one-container pod: Guaranteed with ``cpus`` whole CPUs, or Burstable requesting
    ``milli`` CPU.  Returns its ids, slice and first lines, and the view of the containers in
    ``watch`` (label -> container id) and of the new one, once it runs."""
    if cpus:
        spec = ContainerSpec.guaranteed("app", cpus, command=FIRST_LINES)
    else:
        spec = ContainerSpec("app", command=FIRST_LINES, cpu_request_milli=milli, memory="32Mi")
    with SystemdKubelet(address) as cri:
        started = time.monotonic()
        pod = cri.run(name, [spec])
        seconds = round(time.monotonic() - started, 1)
        cid = pod["app"]
        lines = cri.wait_logs(cid, 2, timeout=120)
        views = {label: view(cri, c) for label, c in {**(watch or {}), name: cid}.items()}
    return {
        "pod_id": pod.id,
        "cid": cid,
        "slice": pod_slice(pod.spec),
        "first_lines": dict(line.split(":", 1) for line in lines[:2]),
        "start_seconds": seconds,
        "views": views,
    }


def stop_pod(
    address: str, pod_id: str, cid: str, slice: str, watch: dict[str, str], grows: list[int]
) -> dict[str, Any]:
    """Stop and remove a pod as kubelet does when it is deleted, then the views of ``watch``
    once the first of them has every CPU of ``grows`` (at most 30 s: then as they are)."""
    with SystemdKubelet(address) as cri:
        started = time.monotonic()
        cri.stop(cid, timeout=0)
        cri.remove(cid)
        cri.stop_pod(pod_id)
        cri.remove_pod(pod_id)
        stop_slice(slice)
        seconds = round(time.monotonic() - started, 1)
        deadline = time.monotonic() + 30
        for cid in list(watch.values())[:1]:
            while not set(grows) <= set(parse_cpu_list(view(cri, cid)["cpus_allowed_list"])):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        return {
            "stop_seconds": seconds,
            "views": {label: view(cri, c) for label, c in watch.items()},
        }


def view(cri: SystemdKubelet, cid: str) -> dict[str, str]:
    """Where the container's first process may run and allocate, as the kernel and systemd
    have it."""
    pid, _ = cri.inspect(cid)
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    cgroup = next(
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if line.startswith("0::")
    )
    directory = CGROUP_ROOT / cgroup.lstrip("/")
    return {
        "cpus_allowed_list": status["Cpus_allowed_list"].strip(),
        "mems_allowed_list": status["Mems_allowed_list"].strip(),
        "scope": directory.name,
        "cpuset_mems": _read(directory / "cpuset.mems"),
        "allowed_cpus": unit_property(directory.name, "AllowedCPUs"),
        "allowed_memory_nodes": unit_property(directory.name, "AllowedMemoryNodes"),
    }


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        return f"<{e.strerror}>"
