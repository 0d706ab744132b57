"""kubelet's systemd cgroup driver, played in the guest (runs *in* the guest): the pod slices
kubelet makes and the CRI requests it sends with them.

With ``cgroupDriver: systemd`` kubelet names every cgroup as a systemd slice and creates it
through systemd (libcontainer's systemd manager, which kubelet vendors):

* ``kubepods.slice`` for Guaranteed pods' parents, ``kubepods-burstable.slice`` and
  ``kubepods-besteffort.slice`` inside it, then one slice per pod:
  ``kubepods-pod<uid>.slice`` (Guaranteed), ``kubepods-burstable-pod<uid>.slice``,
  ``kubepods-besteffort-pod<uid>.slice`` - the uid with ``-`` written as ``_`` (``-`` is the
  slice hierarchy separator);
* each slice is a *transient* unit (D-Bus ``StartTransientUnit``) with ``Wants=`` its parent,
  ``DefaultDependencies=no``, every accounting switched on, and the pod's CPU weight, CPU quota
  and memory limit as unit properties;
* then, as libcontainer does after starting any unit, every controller the root offers is
  enabled in ``cgroup.subtree_control`` of the root and of each ancestor of the new cgroup:
  this is what puts the cpuset controller under ``kubepods.slice`` (systemd itself enables a
  controller only where some unit asks for it).

The pod's ``cgroup_parent`` in RunPodSandbox is then the pod slice's *name*; the runtime (runc
with ``--systemd-cgroup``, CRI-O's systemd manager) makes each container a scope in it:
``cri-containerd-<id>.scope``, ``crio-<id>.scope``.

D-Bus calls go through ``busctl`` (systemd's own client, always in the image).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from .cri import CRIClient, CRIError
from .k8s import BESTEFFORT, BURSTABLE, GUARANTEED, PodSpec, memory_bytes, milli_to_shares

CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBEPODS = "kubepods.slice"
QOS_SLICES = {GUARANTEED: KUBEPODS, BURSTABLE: "kubepods-burstable.slice"}
QOS_SLICES[BESTEFFORT] = "kubepods-besteffort.slice"
LOG_ROOT = Path("/var/log/pods")


class SystemdError(RuntimeError):
    """systemd refused a unit; the message has busctl's output."""


def pod_slice(pod: PodSpec) -> str:
    """kubelet's slice name for ``pod``."""
    uid = pod.uid.replace("-", "_")
    qos = "" if pod.qos == GUARANTEED else f"-{pod.qos}"
    return f"kubepods{qos}-pod{uid}.slice"


def slice_path(name: str) -> str:
    """The cgroup path of a slice: each ``-`` opens a level (``a-b.slice`` is in
    ``a.slice``)."""
    parts = name.removesuffix(".slice").split("-")
    return "/" + "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def cpu_weight(shares: int) -> int:
    """kubelet's (libcontainer's) cgroup v1 shares -> v2 weight conversion."""
    return 1 + ((shares - 2) * 9999) // 262142


def start_slice(name: str, parent: str, properties: list[tuple[str, ...]]) -> None:
    """``StartTransientUnit`` of slice ``name`` under ``parent`` with libcontainer's standard
    properties plus ``properties`` (``(name, D-Bus signature, *busctl value arguments)``); a
    slice that is already running is left as it is (kubelet does the same)."""
    standard = [
        ("Description", "s", f"libcontainer container {name}"),
        ("Wants", "as", "1", parent),
        ("MemoryAccounting", "b", "true"),
        ("CPUAccounting", "b", "true"),
        ("IOAccounting", "b", "true"),
        ("TasksAccounting", "b", "true"),
        ("DefaultDependencies", "b", "false"),
    ]
    args: list[str] = []
    for prop in [*standard, *properties]:
        args += prop
    all_props = len(standard) + len(properties)
    result = subprocess.run(
        [
            # "--": the arguments that follow may start with "-" ("-.slice", the root slice).
            "busctl", "call", "--timeout=60", "--", "org.freedesktop.systemd1",
            "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
            "StartTransientUnit", "ssa(sv)a(sa(sv))", name, "replace", str(all_props),
            *args, "0",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    # systemd's UnitExists error, which busctl prints as its text only.
    exists = ("already exists", "already loaded")
    if result.returncode and not any(text in result.stderr for text in exists):
        raise SystemdError(f"StartTransientUnit {name}: {result.stderr.strip()}")
    _wait_active(name)
    enable_controllers(slice_path(name))


def _wait_active(unit: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        state = unit_property(unit, "ActiveState")
        if state == "active":
            return
        if time.monotonic() > deadline:
            raise SystemdError(f"{unit} is {state}, not active, after {timeout} s")
        time.sleep(0.1)


def unit_property(unit: str, name: str) -> str:
    result = subprocess.run(
        ["systemctl", "show", "--value", "-p", name, unit],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return result.stdout.strip()


def enable_controllers(cgroup_path: str) -> None:
    """libcontainer's CreateCgroupPath: every controller the root offers, enabled in
    ``cgroup.subtree_control`` of the root and of every ancestor of ``cgroup_path`` (not of
    the cgroup itself: a cgroup with processes must not have controllers enabled below)."""
    wanted = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    directory = CGROUP_ROOT
    for part in [p for p in cgroup_path.strip("/").split("/") if p]:
        _enable(directory, wanted)
        directory = directory / part


def _enable(directory: Path, controllers: list[str]) -> None:
    control = directory / "cgroup.subtree_control"
    try:
        control.write_text(" ".join(f"+{c}" for c in controllers))
    except OSError:  # one at a time, as libcontainer falls back; the unavailable ones fail
        for controller in controllers:
            with contextlib.suppress(OSError):
                control.write_text(f"+{controller}")


def ensure_kubepods() -> None:
    """kubelet's node-level slices (created at kubelet start-up)."""
    start_slice(KUBEPODS, "-.slice", [])
    for qos in (BURSTABLE, BESTEFFORT):
        start_slice(QOS_SLICES[qos], KUBEPODS, [])


def start_pod_slice(pod: PodSpec) -> str:
    """The pod's slice with kubelet's resource properties; returns its name."""
    ensure_kubepods()
    properties = [("CPUWeight", "t", str(cpu_weight(milli_to_shares(pod.cpu_request_milli or 0))))]
    if pod.cpu_limit_milli:
        # CFS quota per second: limit_milli * 100 us per 100 ms period.
        properties.append(("CPUQuotaPerSecUSec", "t", str(pod.cpu_limit_milli * 1000)))
    if memory := memory_bytes(pod.memory):
        properties.append(("MemoryMax", "t", str(memory)))
    name = pod_slice(pod)
    start_slice(name, QOS_SLICES[pod.qos or GUARANTEED], properties)
    return name


def stop_slice(name: str) -> None:
    subprocess.run(["systemctl", "stop", name], capture_output=True, check=False, timeout=120)


class SystemdKubelet(CRIClient):
    """The CRI client with kubelet's systemd driver: each pod's slice is started before its
    RunPodSandbox and stopped after its RemovePodSandbox, and named as its cgroup parent."""

    # Under emulation an HTTP/2 handshake can take longer than the host client's 100 ms
    # connection deadline (gRPC's minimum reconnect backoff): the first call then fails
    # UNAVAILABLE "connection attempt timed out before receiving SETTINGS frame".
    reconnect_options = (
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 20000),
        ("grpc.max_reconnect_backoff_ms", 20000),
    )

    def __init__(self, address: str | Path, **kwargs: Any) -> None:
        kwargs.setdefault("log_root", LOG_ROOT)
        kwargs.setdefault("timeout", 120.0)  # emulated CPUs: CRI calls take seconds
        super().__init__(address, top_cgroup="/", **kwargs)
        self._slices: dict[str, str] = {}  # pod id -> slice

    def cgroup_parent(self, pod: PodSpec) -> str:
        return pod_slice(pod)

    def run_pod(self, pod: PodSpec | str, **kwargs: Any) -> str:
        spec = pod if isinstance(pod, PodSpec) else PodSpec(pod, **kwargs)
        name = start_pod_slice(spec)
        pod_id = super().run_pod(spec)
        self._slices[pod_id] = name
        return pod_id

    def remove_pod(self, pod_id: str) -> None:
        super().remove_pod(pod_id)
        if name := self._slices.pop(pod_id, None):
            stop_slice(name)

    def remove_all(self, *, stop_timeout: int = 0, budget: float = 600.0) -> list[str]:
        """Every container and pod removed, then every pod slice under kubepods.slice stopped;
        returns the errors of the last attempt.  Unlike the host client's clean-up (5 s a
        call), each call gets the client's whole timeout, and what failed is tried again: under
        emulation a shim can answer the runtime's own task lookup after the runtime's internal
        deadline ("failed to get task ...: context deadline exceeded"), once in a while."""
        deadline = time.monotonic() + budget
        errors: list[str] = []
        for _ in range(3):
            errors = self._remove_all_once(stop_timeout, deadline)
            if not errors:
                break
        for name in _pod_slices():
            stop_slice(name)
        return errors

    def _remove_all_once(self, stop_timeout: int, deadline: float) -> list[str]:
        try:
            steps: list[Callable[[], None]] = []
            for c in self.containers():
                steps += [partial(self.stop, c.id, stop_timeout), partial(self.remove, c.id)]
            for pod in self.pods():
                steps += [partial(self.stop_pod, pod.id), partial(self.remove_pod, pod.id)]
        except CRIError as e:
            return [str(e)]  # not answering: the runtime's restart or the poweroff clears it
        errors: list[str] = []
        for step in steps:
            if time.monotonic() > deadline:
                return [*errors, "CRI clean-up ran out of time"]
            try:
                step()
            except CRIError as e:
                errors.append(str(e))
        return errors


def _pod_slices() -> list[str]:
    found = []
    for qos_dir in (CGROUP_ROOT / KUBEPODS, *(CGROUP_ROOT / KUBEPODS).glob("kubepods-*.slice")):
        found += [d.name for d in qos_dir.glob("kubepods-*pod*.slice") if d.is_dir()]
    return found


def wait_ready(address: str, timeout: float = 300.0) -> dict[str, str]:
    """The runtime's CRI Version once it answers (guest call from the host)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with SystemdKubelet(address) as cri:
                return cri.version(timeout=10)
        except CRIError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRI at {address} not answering after {timeout} s: {e}") from e
            time.sleep(1)


def remove_all(address: str) -> list[str]:
    """Every pod of the runtime at ``address`` removed, slices stopped (guest call)."""
    with SystemdKubelet(address) as cri:
        return cri.remove_all()
