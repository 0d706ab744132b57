"""Guest side of tests/guest/test_irq.py: exclusive CPUs kept free of device interrupts
(``irq-free.nri-cpuplugin.io``), on the guest's real devices - virtio-net (user networking)
and an AHCI scratch disk, whose interrupts can be moved, and the root disk's virtio-blk
queues, which the kernel manages (harness/guest_vm.py).  Returns what /proc shows; nothing
here asserts.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.cri import ContainerSpec
from harness.guest_kubelet import SystemdKubelet
from harness.guest_vm import SCRATCH_DISK_SERIAL
from harness.host import parse_cpu_list
from harness.k8s import PodSpec

from guest.pinning import kill_daemon
from guest.scenarios import FIRST_LINE, _first_line, _read

ANNOTATION = "irq-free.nri-cpuplugin.io"
PROC_IRQ = Path("/proc/irq")
SCRATCH_DISK = Path(f"/dev/disk/by-id/ata-QEMU_HARDDISK_{SCRATCH_DISK_SERIAL}")
GUEST_ADDRESS = "10.0.2.15/24"  # QEMU user networking's defaults
HOST_ADDRESS = "10.0.2.2"


def interrupts() -> dict[str, Any]:
    """Every numbered interrupt with an action: its affinity (requested and effective), its
    handlers' names and its count on each CPU (/proc/interrupts)."""
    lines = Path("/proc/interrupts").read_text().splitlines()
    cpus = [int(c.removeprefix("CPU")) for c in lines[0].split()]
    found: dict[str, Any] = {}
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        if not label.strip().isdigit():
            continue  # NMI, LOC, RES...: not device interrupts
        fields = rest.split()
        counts = {cpu: int(n) for cpu, n in zip(cpus, fields[: len(cpus)], strict=False)}
        number = label.strip()
        found[number] = {
            "names": " ".join(fields[len(cpus) :]),
            "counts": counts,
            "affinity": _read(PROC_IRQ / number / "smp_affinity_list"),
            "effective": _read(PROC_IRQ / number / "effective_affinity_list"),
        }
    return found


def managed() -> list[str]:
    """Interrupts the kernel manages (it refuses any affinity write: EIO): found by writing
    each one's own affinity back, which changes nothing where it is accepted."""
    refused = []
    for number, irq in interrupts().items():
        path = PROC_IRQ / number / "smp_affinity_list"
        try:
            path.write_text(irq["affinity"])
        except OSError as e:
            if e.errno in (errno.EIO, errno.EPERM, errno.EINVAL):
                refused.append(number)
    return refused


def bring_up_network() -> str:
    """The NIC up with QEMU user networking's address; its name."""
    names = [p.name for p in Path("/sys/class/net").iterdir() if p.name != "lo"]
    if len(names) != 1:
        raise RuntimeError(f"expected one NIC in the guest, found {names}")
    nic = names[0]
    subprocess.run(["ip", "link", "set", nic, "up"], check=True)
    addresses = subprocess.run(["ip", "-o", "addr", "show", nic], capture_output=True, text=True)
    if GUEST_ADDRESS.split("/")[0] not in addresses.stdout:
        subprocess.run(["ip", "addr", "add", GUEST_ADDRESS, "dev", nic], check=True)
    return nic


def load(cpus: str, seconds: float) -> dict[str, Any]:
    """Disk and network load from processes pinned to ``cpus`` (the shared pool): dd with
    O_DIRECT on the scratch disk (each request an interrupt at its completion), and TCP
    connection attempts to a closed port of the host through QEMU's user networking (each a
    SYN out and a RST in)."""
    dd = subprocess.Popen(
        ["taskset", "-c", cpus, "dd", "if=/dev/zero", f"of={SCRATCH_DISK}", "bs=64k",
         "count=1000000", "oflag=direct", "status=none"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    network = subprocess.Popen(
        ["taskset", "-c", cpus, "python3", "-c", _CONNECT_LOOP, HOST_ADDRESS, str(seconds)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = network.communicate(timeout=seconds + 120)
    finally:
        dd.kill()
        dd.wait()
        with contextlib.suppress(ProcessLookupError):
            network.kill()
    return {"connections": out.strip(), "network_errors": err.strip()[-300:]}


# Run by a separate python3 under taskset: connection attempts for argv[2] seconds.
_CONNECT_LOOP = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[2])
attempts = refused = 0
while time.monotonic() < end:
    attempts += 1
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((sys.argv[1], 9))
    except OSError:
        refused += 1
    finally:
        s.close()
print(f"{attempts} attempts, {refused} refused")
"""


def _deltas(before: dict[str, Any], after: dict[str, Any], cpus: set[int]) -> dict[str, int]:
    """Per interrupt (present in both), how many times it fired on ``cpus`` in between."""
    found = {}
    for number, irq in after.items():
        if number in before:
            delta = sum(irq["counts"][c] - before[number]["counts"][c] for c in cpus)
            if delta:
                found[f"{number} {irq['names']}"] = delta
    return found


def pinned_pod(cri: SystemdKubelet, name: str, irq_free: bool) -> tuple[Any, set[int]]:
    annotations = {ANNOTATION: "true"} if irq_free else {}
    spec = ContainerSpec.guaranteed("app", 2, command=FIRST_LINE)
    pod = cri.run(PodSpec.for_containers(name, [spec], annotations=annotations), [spec])
    return pod, set(parse_cpu_list(_first_line(cri, pod["app"])))


def remove(cri: SystemdKubelet, pod: Any) -> None:
    cri.stop(pod["app"], timeout=0)
    cri.remove(pod["app"])
    cri.stop_pod(pod.id)
    cri.remove_pod(pod.id)


def settled(keep: set[int], want_free: bool, timeout: float = 30.0) -> dict[str, Any]:
    """/proc/interrupts once every changeable interrupt is off ``keep`` (``want_free``) or
    back on its CPUs; the daemon writes in the background of the pod's start."""
    deadline = time.monotonic() + timeout
    refused = set(managed())
    while True:
        now = interrupts()
        on = [n for n, irq in now.items()
              if n not in refused and keep & set(parse_cpu_list(irq["affinity"]))]  # fmt: skip
        if (not on) == want_free or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def irq_scenario(address: str, load_seconds: float = 20.0) -> dict[str, Any]:
    """Baseline; a pinned pod that opted in and one that did not; load; removal of the
    opted-in pod; a new opted-in pod, kill -9 of the daemon, its removal after the restart."""
    nic = bring_up_network()
    result: dict[str, Any] = {"nic": nic, "scratch_disk": str(SCRATCH_DISK)}
    # The devices' names in /proc/interrupts (virtioN for the NIC, the disk's controller).
    result["nic_device"] = Path(f"/sys/class/net/{nic}/device").resolve().name
    result["scratch_device"] = SCRATCH_DISK.resolve().name
    result["managed"] = refused = managed()
    baseline = interrupts()
    result["baseline"] = {n: i["affinity"] for n, i in baseline.items()}
    result["baseline_default"] = _read(PROC_IRQ / "default_smp_affinity")
    with SystemdKubelet(address) as cri:
        opted, opted_cpus = pinned_pod(cri, "irq-free", True)
        _, other_cpus = pinned_pod(cri, "irq-plain", False)
        result["opted_cpus"], result["other_cpus"] = sorted(opted_cpus), sorted(other_cpus)
        held = settled(opted_cpus, True)
        result["held"] = {n: {"names": i["names"], "affinity": i["affinity"],
                              "effective": i["effective"], "total": sum(i["counts"].values())}
                          for n, i in held.items()}  # fmt: skip
        result["held_default"] = _read(PROC_IRQ / "default_smp_affinity")
        online = set(parse_cpu_list(_read(Path("/sys/devices/system/cpu/online"))))
        pool = ",".join(str(c) for c in sorted(online - opted_cpus - other_cpus))
        result["load_cpus"] = pool
        before = interrupts()
        started = time.monotonic()
        result["load"] = load(pool, load_seconds)
        result["load_seconds"] = round(time.monotonic() - started, 1)
        after = interrupts()
        result["after_load"] = {n: {"effective": i["effective"],
                                    "total": sum(i["counts"].values())}
                                for n, i in after.items()}  # fmt: skip
        changeable = {n for n in after if n not in refused}
        result["deltas"] = {
            label: {
                "changeable": _deltas(
                    {n: before[n] for n in changeable if n in before}, after, cpus
                ),
                "managed": _deltas({n: before[n] for n in refused if n in before}, after, cpus),
            }
            for label, cpus in (("opted", opted_cpus), ("other", other_cpus),
                                ("pool", online - opted_cpus - other_cpus))
        }  # fmt: skip
        remove(cri, opted)
        released = settled(opted_cpus, False)
        result["released"] = {n: i["affinity"] for n, i in released.items()}
        result["released_default"] = _read(PROC_IRQ / "default_smp_affinity")
        # Crash-safety: a daemon killed while it keeps CPUs free, restarted by systemd.
        again, again_cpus = pinned_pod(cri, "irq-again", True)
        result["again_cpus"] = sorted(again_cpus)
        result["again_held"] = {n: i["affinity"] for n, i in settled(again_cpus, True).items()}
        result["kill"] = kill_daemon()
        time.sleep(2)  # the restarted daemon's first look at /proc/irq is part of its start
        result["after_kill"] = {n: i["affinity"] for n, i in interrupts().items()}
        result["after_kill_default"] = _read(PROC_IRQ / "default_smp_affinity")
        remove(cri, again)
        result["restored"] = {n: i["affinity"] for n, i in settled(again_cpus, False).items()}
        result["restored_default"] = _read(PROC_IRQ / "default_smp_affinity")
        cri.remove_all()
    return result
