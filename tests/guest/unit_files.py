"""What the runtime and systemd leave in systemd's unit files for a container's scope, run in
the guest (``Guest.call``) with the daemon placing containers.

The daemon's hand-over (nri_cpuplugin/daemon/units.py) relies on three behaviours of the OCI runtime
and systemd, which differ by release: a scope created with a cpuset gets ``AllowedCPUs`` in its
transient unit file; a runtime's update of the cpuset leaves a transient drop-in; an empty
``AllowedCPUs`` leaves the cgroup file alone on a reload.  This returns the files themselves at each
step, what systemd says (``AllowedCPUs``), what the cgroup holds, and what the daemon's reader of
those files (hardware/systemd/unit_config.py) concludes, for the test on the host to compare.
Nothing here asserts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from harness.cri import ContainerSpec
from harness.guest_kubelet import SystemdKubelet, unit_property
from harness.host import parse_cpu_list

from guest.pinning import _wait_shared_off, scope_dir
from guest.scenarios import FIRST_LINE, _first_line, _read, unit_dir
from nri_cpuplugin.hardware.systemd.unit_config import CONTROL, TRANSIENT, holds_cpuset


def files_of(unit: str) -> dict[str, str]:
    """The unit's transient file and every drop-in systemd keeps for it at run time, by path
    (relative to /), with their text."""
    found: dict[str, str] = {}
    root = Path("/")
    candidates = [root / TRANSIENT / unit]
    for base in (*CONTROL, TRANSIENT):
        directory = root / base / f"{unit}.d"
        if directory.is_dir():
            candidates += sorted(directory.iterdir())
    for path in candidates:
        if path.is_file():
            found[str(path)] = path.read_text(errors="replace")
    return found


def _state(cri: SystemdKubelet, cid: str) -> dict[str, Any]:
    directory = unit_dir(scope_dir(cri, cid))
    unit = directory.name
    return {
        "unit": unit,
        "files": files_of(unit),
        "allowed_cpus": unit_property(unit, "AllowedCPUs"),
        "cpuset_cpus": _read(directory / "cpuset.cpus"),
        "cpu_max": _read(directory / "cpu.max"),
        "holds_cpuset": holds_cpuset(unit),  # the daemon's reading of the files above
    }


def _reload() -> str:
    done = subprocess.run(
        ["systemctl", "daemon-reload"], capture_output=True, text=True, timeout=300, check=False
    )
    return f"rc {done.returncode} {done.stderr.strip()[-200:]}"


def unit_files(address: str, runtime: str) -> dict[str, Any]:
    """A Burstable pod, then a 2-CPU Guaranteed one (the daemon hands the Burstable scope over
    to its cgroup files), a ``daemon-reload``, then an UpdateContainerResources with a cpuset on
    the Burstable container (the OCI runtime's ``update`` through systemd), and a reload
    again; then a second Guaranteed pod (the pool shrinks under a unit that holds a cpuset
    again) and a reload: the unit files, systemd's and the cgroup's cpusets after each
    step."""
    result: dict[str, Any] = {"runtime": runtime, "steps": {}}
    steps = result["steps"]
    with SystemdKubelet(address) as cri:
        shared = cri.run(
            "files-shared", [ContainerSpec("app", command=FIRST_LINE, cpu_request_milli=100)]
        )
        _first_line(cri, shared["app"])
        steps["shared_created"] = _state(cri, shared["app"])
        pinned = cri.run("files-pinned", [ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)])
        result["pinned_first_line"] = first = _first_line(cri, pinned["app"])
        steps["pinned_created"] = _state(cri, pinned["app"])
        exclusive = set(parse_cpu_list(first))
        _, result["shared_moved_after_s"] = _wait_shared_off(cri, shared["app"], exclusive)
        steps["shared_handed_over"] = _state(cri, shared["app"])
        result["reload"] = _reload()
        steps["shared_after_reload"] = _state(cri, shared["app"])
        # A cpuset the runtime is told to set: the shared CPUs as they are (what kubelet's
        # static CPU manager would send), so the container stays off the exclusive ones.
        pool = steps["shared_after_reload"]["cpuset_cpus"]
        result["update_to"] = pool
        cri.update_resources(shared["app"], cpuset_cpus=pool)
        steps["shared_after_update"] = _state(cri, shared["app"])
        result["reload_after_update"] = _reload()
        steps["shared_after_update_reload"] = _state(cri, shared["app"])
        # The unit holds a cpuset again: the next pool change must hand it over again.
        second = cri.run("files-pinned-2", [ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)])
        result["second_first_line"] = second_first = _first_line(cri, second["app"])
        both = exclusive | set(parse_cpu_list(second_first))
        _, result["shared_moved_again_after_s"] = _wait_shared_off(cri, shared["app"], both)
        steps["shared_after_second_pinned"] = _state(cri, shared["app"])
        result["reload_after_second"] = _reload()
        steps["shared_after_second_reload"] = _state(cri, shared["app"])
        steps["pinned_after_reloads"] = _state(cri, pinned["app"])
        cri.remove_all()
    return result
