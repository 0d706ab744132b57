"""What the guest tests do *in* the guest (run there by ``Guest.call``, harness/guest_call.py):
each function drives the node's runtime through CRI as kubelet's systemd driver would
(harness/guest_kubelet.py) and returns what the kernel and systemd say, as JSON, for the test
on the host to judge.  Nothing here asserts: a wrong value comes back as it is.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from harness import guest_kubelet
from harness.cri import ContainerSpec
from harness.guest_kubelet import CGROUP_ROOT, KUBEPODS, SystemdKubelet, unit_property
from harness.host import parse_cpu_list

# The container's own first view of its CPUs, before anything could move it: its first log line.
FIRST_LINE = "grep Cpus_allowed_list /proc/self/status; exec sleep infinity"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        return f"<{e.strerror}>"


def node() -> dict[str, Any]:
    """The node as kubelet finds it, once its slices exist."""
    guest_kubelet.ensure_kubepods()
    kubepods = CGROUP_ROOT / KUBEPODS
    return {
        "cgroup_fs": _fs_type(CGROUP_ROOT),
        "cgroup_statfs": subprocess.run(
            ["stat", "-f", "-c", "%T", str(CGROUP_ROOT)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip(),
        "v1_hierarchies": [
            line.split()[1]
            for line in _read(Path("/proc/mounts")).splitlines()
            if line.split()[2] == "cgroup"
        ],
        "pid1": _read(Path("/proc/1/comm")),
        "root_controllers": _read(CGROUP_ROOT / "cgroup.controllers").split(),
        "root_subtree_control": _read(CGROUP_ROOT / "cgroup.subtree_control").split(),
        "kubepods_controllers": _read(kubepods / "cgroup.controllers").split(),
        "kubepods_subtree_control": _read(kubepods / "cgroup.subtree_control").split(),
        "kubepods_cpus_effective": _read(kubepods / "cpuset.cpus.effective"),
        "kubepods_mems_effective": _read(kubepods / "cpuset.mems.effective"),
        "burstable_controllers": _read(
            kubepods / "kubepods-burstable.slice" / "cgroup.controllers"
        ).split(),
        "kernel_release": os.uname().release,
        "systemd_version": subprocess.run(
            ["systemctl", "--version"], capture_output=True, text=True, check=False
        ).stdout.split("\n")[0],
    }


def _fs_type(path: Path) -> str:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if left.split()[4] == str(path):
            return right.split()[0]
    return "<not a mount point>"


def unit_dir(directory: Path) -> Path:
    """The cgroup of the systemd unit a container's cgroup is in: the cgroup itself for runc's
    scopes; its parent for crun's, which puts the container in ``<scope>/container`` (crun's
    ``run.oci.systemd.subgroup``, by default ``container`` under cgroup v2)."""
    return next(
        (d for d in (directory, *directory.parents) if d.name.endswith(".scope")), directory
    )


def container_facts(cri: SystemdKubelet, cid: str) -> dict[str, Any]:
    """Where the container runs and on which CPUs, as the kernel and systemd say."""
    pid, spec = cri.inspect(cid)
    cgroup = next(
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if line.startswith("0::")
    )
    directory = CGROUP_ROOT / cgroup.lstrip("/")
    scope_cgroup = unit_dir(directory)
    scope = scope_cgroup.name
    return {
        "id": cid,
        "pid": pid,
        "cgroups_path": spec.get("linux", {}).get("cgroupsPath", ""),
        "spec_cpus": spec.get("linux", {}).get("resources", {}).get("cpu", {}).get("cpus", ""),
        "cgroup": cgroup,
        "scope": scope,
        "slice": scope_cgroup.parent.name,
        "scope_cpuset_cpus": _read(scope_cgroup / "cpuset.cpus"),
        "scope_controllers": _read(directory / "cgroup.controllers").split(),
        "pod_slice_subtree_control": _read(directory.parent / "cgroup.subtree_control").split(),
        "cpuset_cpus": _read(directory / "cpuset.cpus"),
        "cpuset_cpus_effective": _read(directory / "cpuset.cpus.effective"),
        "cpuset_mems_effective": _read(directory / "cpuset.mems.effective"),
        "cpus_allowed_list": _cpus_allowed(pid),
        "allowed_cpus": unit_property(scope, "AllowedCPUs"),
        "effective_cpus": unit_property(scope, "EffectiveCPUs"),
        "unit_active": unit_property(scope, "ActiveState"),
    }


def _cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return ""


def _first_line(cri: SystemdKubelet, cid: str) -> str:
    lines = cri.wait_logs(cid, "Cpus_allowed_list", timeout=120)
    return next(line for line in lines if "Cpus_allowed_list" in line).split(":", 1)[1].strip()


def pinned_and_shared(address: str, exclusive_cpus: int = 2) -> dict[str, Any]:
    """A Burstable pod, then a Guaranteed pod with ``exclusive_cpus`` whole CPUs, with the
    project's daemon running: where each container is once the daemon has placed them."""
    with SystemdKubelet(address) as cri:
        shared = cri.run(
            "shared", [ContainerSpec("app", command=FIRST_LINE, cpu_request_milli=100)]
        )
        shared_first = _first_line(cri, shared["app"])
        pinned = cri.run(
            "pinned", [ContainerSpec.guaranteed("app", exclusive_cpus, command=FIRST_LINE)]
        )
        pinned_first = _first_line(cri, pinned["app"])
        pinned_facts = container_facts(cri, pinned["app"])
        # The shared container's move is part of the pinned one's creation: it must already
        # be off those CPUs; a few seconds of polling only tells "late" from "never".
        exclusive = set(parse_cpu_list(pinned_first))
        deadline = time.monotonic() + 30
        waited = 0.0
        while True:
            shared_facts = container_facts(cri, shared["app"])
            overlap = exclusive & set(parse_cpu_list(shared_facts["cpus_allowed_list"]))
            if not overlap or time.monotonic() > deadline:
                break
            time.sleep(0.5)
            waited = round(time.monotonic() - deadline + 30, 1)
        return {
            "shared_first_line": shared_first,
            "pinned_first_line": pinned_first,
            "pinned": pinned_facts,
            "shared": shared_facts,
            "shared_moved_after_s": waited,
            "pinned_pod_slice": guest_kubelet.pod_slice(pinned.spec),
            "shared_pod_slice": guest_kubelet.pod_slice(shared.spec),
            "runtime": cri.version(),
        }
