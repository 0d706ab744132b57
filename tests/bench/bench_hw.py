"""Hardware awareness benchmarks: CPU hotplug reaction time and the cost of NIC inspection.

* ``bench_hotplug_latency`` takes CPU 1 of this machine offline and back ``cycles`` times under
  real containerd 2.1.9 + runc with the daemon, an exclusive container on CPU 1 and a shared one
  on CPU 0.  The clock starts when the kernel's uevent reaches this process (its own netlink
  socket: the kernel multicasts the same message to the daemon at the same instant) and stops
  when the affected container's cgroup has its new cpuset *and* its process runs there
  (``Cpus_allowed_list``; on offline that includes putting back what cgroup v1 evicted).  CPU 1
  is always brought back, even on failure.  It disturbs everything on the machine: run it on
  an otherwise idle one.
* ``bench_nic_inspection`` measures the daemon's CreateContainer handler (daemon/service.py,
  as ``nri-cpuplugin run`` builds it) for an exclusive container whose pod has a real network
  namespace (veth, or veth + macvlan on the host NIC), against the same handler for a
  host-network pod (no inspection), alternating.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from e2e.daemon import Daemon, wait_for
from harness import host
from harness.containerd import Containerd
from harness.k8s import ContainerSpec
from netns_util import host_nic, pod_netns

from .scratch import scratch
from .stats import summary

CPU = 1
ONLINE_FILE = Path(f"/sys/devices/system/cpu/cpu{CPU}/online")


def _uevent_socket() -> socket.socket:
    from pyroute2.netlink import NETLINK_KOBJECT_UEVENT

    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                         NETLINK_KOBJECT_UEVENT)  # fmt: skip
    sock.bind((0, 1))
    return sock


def _wait_uevent(sock: socket.socket, action: str, timeout: float = 5.0) -> float:
    """monotonic() when the ``action`` uevent of cpu<CPU> arrived."""
    from pyroute2.netlink.uevent import MarshalUevent

    marshal = MarshalUevent()
    deadline = time.monotonic() + timeout
    want = f"/devices/system/cpu/cpu{CPU}"
    while time.monotonic() < deadline:
        if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        data = sock.recv(1 << 16)
        at = time.monotonic()
        for msg in marshal.parse(data):
            if (msg.get("SUBSYSTEM"), msg.get("ACTION"), msg.get("DEVPATH")) == (
                "cpu",
                action,
                want,
            ):
                return at
    raise TimeoutError(f"no {action} uevent for cpu{CPU} within {timeout}s")


def _restore_cpu() -> None:
    with contextlib.suppress(OSError):
        if ONLINE_FILE.read_text().strip() != "1":
            ONLINE_FILE.write_text("1")


def _settled(cri, cid: str, path: str, cpus: str) -> bool:
    try:
        pid = cri.inspect(cid).pid
        return (
            host.read_cgroup(path, "cpuset.cpus") == cpus
            and host.proc_cgroups(pid)["cpuset"] == path
            and host.cpus_allowed_list(pid) == cpus
        )
    except (OSError, LookupError):
        return False


def _poll_until(check, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.0002)
    raise TimeoutError("the containers did not settle")


def bench_hotplug_latency(cycles: int = 20) -> dict:
    """Uevent to every affected container's cgroup updated, per offline and online (ms)."""
    if host.online_cpus() != [0, 1]:
        raise RuntimeError(f"needs CPUs 0-1 online, found {host.online_cpus()}")
    offline: list[float] = []
    online: list[float] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        stack.callback(_restore_cpu)
        runtime = stack.enter_context(Containerd("2.1", debug=False))
        daemon = Daemon(runtime.nri_socket, Path(tmp) / "state").start()
        stack.callback(daemon.stop)
        cri = runtime.cri()
        shared = cri.run("shared", [ContainerSpec("s", cpu_request_milli=250, memory="32Mi")])
        pinned = cri.run("pinned", [ContainerSpec.guaranteed("p", 1)])
        p, s = pinned["p"], shared["s"]
        p_path, s_path = cri.cgroup_path(p), cri.cgroup_path(s)
        _poll_until(lambda: _settled(cri, p, p_path, "1") and _settled(cri, s, s_path, "0"))
        sock = stack.enter_context(contextlib.closing(_uevent_socket()))
        for _ in range(cycles):
            ONLINE_FILE.write_text("0")
            try:
                t0 = _wait_uevent(sock, "offline")
                offline.append(_poll_until(lambda: _settled(cri, p, p_path, "0")) - t0)
                # Let the daemon's bounded re-checks for evicted processes run their course.
                time.sleep(0.15)
            finally:
                ONLINE_FILE.write_text("1")
            t0 = _wait_uevent(sock, "online")
            online.append(_poll_until(lambda: _settled(cri, p, p_path, "1")) - t0)
            assert _settled(cri, s, s_path, "0")
        wait_for("the daemon's last record", lambda: len(daemon.records("hotplug-applied")) >= 2)
        own = [float(r["LATENCY_MS"]) / 1e3 for r in daemon.records("hotplug-applied")]
        degraded = len(daemon.records("degraded"))
        restored = len(daemon.records("cpu-restored"))
        repairs = len(daemon.records("cgroup-repair"))
    return {
        "cycles": cycles,
        "offline": summary(offline),
        "online": summary(online),
        # uevent read by the daemon -> its cgroup writes done (its own audit records)
        "daemon_uevent_to_written": summary(own),
        "degraded_records": degraded,
        "restored_records": restored,
        "evicted_process_repairs": repairs,
    }


def bench_nic_inspection(rounds: int = 300) -> dict:
    """The CreateContainer handler of an exclusive container, awaited as the stub awaits it:
    pod with its own netns (veth; veth + macvlan on the host NIC) vs a host-network pod (no
    inspection), alternating.  What follows each answer is waited for outside the figures."""
    from nri_cpuplugin.daemon.service import Daemon as CPUDaemon
    from nri_cpuplugin.hardware import nic
    from nri_cpuplugin.nri.pb import nri_pb2 as pb
    from nri_cpuplugin.ops.audit import Audit
    from nri_cpuplugin.ops.config import Settings

    def pod(name: str, netns: str | None) -> pb.PodSandbox:
        sandbox = pb.PodSandbox(id=f"sb-{name}", name=name, uid=f"uid-{name}", namespace="b")
        sandbox.linux.cgroup_parent = f"/kubepods/pod{name}"
        if netns is not None:
            sandbox.linux.namespaces.add(type="network", path=netns)
        return sandbox

    def container(name: str, sandbox: pb.PodSandbox) -> pb.Container:
        c = pb.Container(id=f"{name:0<64}", pod_sandbox_id=sandbox.id, name=name, state=3)
        c.linux.resources.cpu.shares.value = 1024
        c.linux.resources.cpu.period.value = 100000
        c.linux.resources.cpu.quota.value = 100000
        return c

    lower = host_nic()
    samples: dict[str, list[float]] = {"host_network": [], "veth": [], "veth_macvlan": []}
    lookups: dict[str, list[float]] = {"veth": [], "veth_macvlan": []}
    with ExitStack() as stack:
        tmp = stack.enter_context(scratch())
        veth = stack.enter_context(pod_netns())
        veth.add_veth("eth0")
        both = stack.enter_context(pod_netns())
        both.add_veth("eth0")
        both.add_macvlan(lower.name, "net1")
        daemon = CPUDaemon(Settings(state_dir=tmp, reserved_cpu_count=1), Audit(lambda r: None))
        stack.callback(daemon.release_claim)
        nri = daemon.adapter
        pods = {
            "host_network": pod("host", None),
            "veth": pod("veth", veth.path),
            "veth_macvlan": pod("both", both.path),
        }

        async def measure() -> None:
            await nri.configure("", "bench", "v0")
            daemon.stop_hotplug()
            for i in range(rounds + 10):
                for side, sandbox in pods.items():
                    c = container(f"{side}{i}", sandbox)
                    start = time.perf_counter()
                    adjust, _ = await nri.create_container(sandbox, c)
                    elapsed = time.perf_counter() - start
                    assert adjust.linux.resources.cpu.cpus
                    await nri.stop_container(sandbox, c)
                    await nri.remove_container(sandbox, c)
                    await daemon.drain()
                    if i >= 10:
                        samples[side].append(elapsed)
                for side, ns in (("veth", veth), ("veth_macvlan", both)):
                    start = time.perf_counter()
                    nic.locality(ns.path, {}, "c", "/sys", daemon.node.policy.topology)
                    if i >= 10:
                        lookups[side].append(time.perf_counter() - start)

        asyncio.run(measure())
    base = statistics.median(samples["host_network"])
    return {
        "rounds": rounds,
        "create_host_network": summary(samples["host_network"]),
        "create_netns_veth": summary(samples["veth"]),
        "create_netns_veth_macvlan": summary(samples["veth_macvlan"]),
        "added_median_ms_veth": (statistics.median(samples["veth"]) - base) * 1e3,
        "added_median_ms_veth_macvlan": (statistics.median(samples["veth_macvlan"]) - base) * 1e3,
        "ratio_veth": statistics.median(samples["veth"]) / base,
        "ratio_veth_macvlan": statistics.median(samples["veth_macvlan"]) / base,
        "inspection_veth": summary(lookups["veth"]),
        "inspection_veth_macvlan": summary(lookups["veth_macvlan"]),
    }


def main() -> None:
    import json

    print(json.dumps({"nic_inspection": bench_nic_inspection()}, indent=2))
    print(json.dumps({"hotplug": bench_hotplug_latency()}, indent=2))


if __name__ == "__main__":
    main()
