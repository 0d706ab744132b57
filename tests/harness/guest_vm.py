"""The guest node's QEMU process: the machine it emulates, the accelerator, its console log, and
a stop that works whatever state the guest is in.

The machine is the production-node shape the tests need, as the guest kernel must report it:
two sockets of two cores with two threads each (8 CPUs), one NUMA node per socket with its
own memory, on q35.  Facts measured on the project's machines:

* ``-cpu max`` alone makes the guest see one thread per core: SMT siblings only appear with
  ``vendor=GenuineIntel`` (the AMD topology leaves of TCG's ``max`` are not enough);
* without ``-monitor`` (the CPU's MONITOR/MWAIT flag off) the guest hangs after
  "sched_clock: Marking stable" under TCG;
* QEMU 7.2's multi-threaded TCG (a host thread per virtual CPU) runs code that another virtual
  CPU has just patched stale.  The kernel patches its text whenever a static key flips, first at
  "sched_clock: Marking stable": kernel 6.12 oopsed there ("Oops: int3" in
  sched_clock_idle_wakeup_event, 1 boot of 2) and kernel 6.1 hung there for the 900 s boot
  budget (once in a CI run).  All virtual CPUs therefore run on one host thread
  (``thread=single``), where patched code is never run stale;
* ``/dev/kvm`` may exist without hardware virtualisation (a nested or emulated host): KVM is
  used only when the host CPU has ``vmx`` or ``svm`` and ``/dev/kvm`` opens, TCG otherwise.

The disk is the cached image with ``snapshot=on``: writes go to a temporary overlay that QEMU
discards, so every boot starts from the same state and the cache is never changed.  Host
directories are shared with virtio-9p; the agent's port and QMP are unix sockets in a short
private directory (socket paths are limited to 108 bytes, checkouts are not).

A stop asks QEMU to quit over QMP and then signals it by pid (SIGTERM, SIGKILL), so it ends
even when the guest hangs.  :func:`reap_stale` does the same for a VM whose test process died.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import debs, guest_image, host, host_tools, shortpaths
from .guest_agent import PORT_NAME
from .guest_image import GuestImage

SOCKETS = 2
CORES_PER_SOCKET = 2
THREADS_PER_CORE = 2
CPUS = SOCKETS * CORES_PER_SOCKET * THREADS_PER_CORE
MEMORY_MIB_PER_NODE = 2048  # one NUMA node per socket
SCRATCH_DISK_MIB = 256
SCRATCH_DISK_SERIAL = "nri-scratch"  # /dev/disk/by-id/ata-QEMU_HARDDISK_nri-scratch
KERNEL_ARGS = (
    "root=/dev/vda",
    "rw",
    "console=ttyS0",
    # cgroup v2 only, as on a production node (bookworm's default too; said explicitly).
    "systemd.unified_cgroup_hierarchy=1",
    "cgroup_no_v1=all",
    # No AppArmor userspace in the image: containerd and CRI-O would try to load profiles.
    "apparmor=0",
    # Speculation mitigations cost most under emulation (page-table switches on every
    # kernel entry) and protect nothing in a throwaway test guest.
    "mitigations=off",
    # A panic reboots, and -no-reboot turns that into QEMU exiting: the host sees it at once.
    "panic=-1",
    # Under TCG on a busy 2-CPU host the 8 virtual CPUs' threads are often descheduled for
    # seconds.  The clocksource watchdog then calls TSC unstable and switches clocksource
    # (a stop_machine: all 8 CPUs must meet), and the lockup and RCU stall detectors print
    # every CPU's backtrace over the emulated serial port: seen to stall a guest for minutes
    # while other test runs loaded the host.  TSC is the host's clock here; the detectors
    # would only report the host's load.
    "tsc=reliable",
    "nowatchdog",
    "rcupdate.rcu_cpu_stall_suppress=1",
    "sysctl.kernel.hung_task_timeout_secs=0",
)


class GuestVMError(RuntimeError):
    """QEMU could not be started or stopped; the message carries the console's tail."""


@dataclass(frozen=True)
class Share:
    """A host directory the guest mounts (virtio-9p) at ``guest_path`` under 9p ``tag``."""

    tag: str
    host_path: Path
    guest_path: str
    readonly: bool = True


def accelerator() -> tuple[str, str]:
    """``("kvm" | "tcg", why)``: KVM only when the host CPU has hardware virtualisation and
    /dev/kvm can be opened."""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    hardware = flags & {"vmx", "svm"}
    if not hardware:
        return "tcg", "TCG (software emulation): the host CPU has no vmx/svm flag"
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
    except OSError as e:
        return "tcg", f"TCG (software emulation): /dev/kvm cannot be opened ({e.strerror})"
    return "kvm", f"KVM: the host CPU has {'/'.join(sorted(hardware))} and /dev/kvm opens"


def _escape_option(value: str) -> str:
    """QEMU option values separate by commas; a literal comma is written twice."""
    return value.replace(",", ",,")


class VM:
    """One QEMU process running the guest.  :meth:`start` launches it; :meth:`stop` ends it."""

    def __init__(
        self,
        image: GuestImage,
        shares: list[Share],
        *,
        lab: Path = debs.LAB,
        token: str | None = None,
    ) -> None:
        self.image = image
        self.shares = shares
        self.lab = lab
        self.token = token or secrets.token_hex(4)
        self.dir = lab / "guest" / "run" / self.token  # console log, record, results
        self.short_dir: Path | None = None  # the sockets, made by start()
        self.accel, self.accel_reason = accelerator()
        self._proc: subprocess.Popen[bytes] | None = None
        self._console: object | None = None

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"

    @property
    def agent_socket(self) -> Path:
        assert self.short_dir is not None
        return self.short_dir / "agent.sock"

    @property
    def qmp_socket(self) -> Path:
        assert self.short_dir is not None
        return self.short_dir / "qmp.sock"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def command(self) -> list[str]:
        qemu = str(host_tools.ensure("qemu-system-x86_64", lab=self.lab)["qemu-system-x86_64"])
        # TCG: one host thread per virtual CPU (x86 on x86 is safe for multi-threaded TCG).
        accel = ["-accel", "kvm" if self.accel == "kvm" else "tcg,thread=single"]
        numa: list[str] = []
        for node in range(SOCKETS):
            numa += [
                "-object", f"memory-backend-ram,id=mem{node},size={MEMORY_MIB_PER_NODE}M",
                "-numa", f"node,nodeid={node},memdev=mem{node}",
                "-numa", f"cpu,node-id={node},socket-id={node}",
            ]  # fmt: skip
        shares: list[str] = []
        for index, share in enumerate(self.shares):
            options = f"local,id=fs{index},path={_escape_option(str(share.host_path))}"
            options += ",security_model=none" + (",readonly=on" if share.readonly else "")
            shares += [
                "-fsdev", options,
                "-device", f"virtio-9p-pci,fsdev=fs{index},mount_tag={share.tag}",
            ]  # fmt: skip
        return [
            qemu,
            "-name", f"nri-guest-{self.token}",
            "-machine", "q35",
            *accel,
            "-cpu", "max,vendor=GenuineIntel,-monitor",
            "-smp", f"{CPUS},sockets={SOCKETS},cores={CORES_PER_SOCKET},threads={THREADS_PER_CORE}",
            "-m", f"{MEMORY_MIB_PER_NODE * SOCKETS}M",
            *numa,
            "-kernel", str(self.image.kernel),
            "-initrd", str(self.image.initrd),
            "-append", " ".join(KERNEL_ARGS),
            "-drive", f"file={_escape_option(str(self.image.disk))},format=raw,if=virtio,"
            "snapshot=on,cache=unsafe",
            # Serial console (and QEMU's monitor, unused) on stdout, which goes to the log.
            "-nographic",
            "-vga", "none",
            # Devices with interrupts the IRQ tests move (tests/guest/test_irq.py): a NIC
            # (virtio-net, user networking: no host set-up, no tap; its queue interrupts are not
            # managed, so their affinity can be changed) and a scratch disk on q35's AHCI
            # controller (one MSI, changeable) - the root disk's virtio-blk has one managed
            # interrupt per CPU, which the kernel keeps where it put them.
            "-nic", "user,model=virtio-net-pci",
            "-drive", f"if=none,id=scratch,file={_escape_option(str(self.scratch_disk))},"
            "format=raw,cache=unsafe",
            "-device", f"ide-hd,drive=scratch,bus=ide.0,serial={SCRATCH_DISK_SERIAL}",
            "-no-reboot",
            "-device", "virtio-rng-pci",
            "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
            "-chardev", f"socket,id=agent,path={self.agent_socket},server=on,wait=off",
            "-device", "virtio-serial-pci,id=vser0",
            "-device", f"virtserialport,bus=vser0.0,chardev=agent,name={PORT_NAME}",
            *shares,
        ]  # fmt: skip

    @property
    def scratch_disk(self) -> Path:
        return self.dir / "scratch.img"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # Sparse, thrown away with the run directory: only the I/O's interrupts matter.
        with self.scratch_disk.open("wb") as disk:
            disk.truncate(SCRATCH_DISK_MIB << 20)
        self.short_dir = shortpaths.make("guest", instance=self.dir)
        command = self.command()
        console = self.console_log.open("ab")
        self._console = console
        console.write(f"==== harness: {' '.join(command)}\n".encode())
        console.flush()
        # Own session: a Ctrl-C on the test run reaches QEMU only through stop().
        self._proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            start_new_session=True,
        )
        (self.dir / "vm.json").write_text(
            json.dumps(
                {
                    "owner": shortpaths.owner(),
                    "qemu": [self._proc.pid, host.start_time(self._proc.pid)],
                    "short_dir": str(self.short_dir),
                    "accel": self.accel,
                }
            )
        )

    def exited(self) -> int | None:
        """QEMU's exit status once it ended, else None."""
        return self._proc.poll() if self._proc is not None else None

    def console_tail(self, lines: int = 60) -> str:
        try:
            raw = self.console_log.read_text(errors="replace")
        except OSError:
            return f"(no console log at {self.console_log})"
        text = _strip_terminal_codes(raw).splitlines()[-lines:]
        return f"--- last {len(text)} lines of {self.console_log} ---\n" + "\n".join(text)

    def stop(self, timeout: float = 30.0) -> list[str]:
        """End QEMU: QMP ``quit``, then SIGTERM, then SIGKILL, by pid.  Returns what is left
        (empty when clean)."""
        problems: list[str] = []
        if self._proc is not None:
            if self._proc.poll() is None:
                _qmp_quit(self.qmp_socket)
                for sig, wait in ((None, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                    if sig is not None and self._proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            self._proc.send_signal(sig)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._proc.wait(wait)
                    if self._proc.poll() is not None:
                        break
            if self._proc.poll() is None:
                problems.append(f"QEMU (pid {self._proc.pid}) did not exit after SIGKILL")
        if self._console is not None:
            self._console.close()  # type: ignore[attr-defined]
            self._console = None
        if self.short_dir is not None and not problems:
            shutil.rmtree(self.short_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            if not problems:
                self.scratch_disk.unlink(missing_ok=True)
                (self.dir / "vm.json").unlink()
        return problems


def _qmp_quit(path: Path) -> None:
    """Ask QEMU to quit (the guest is not asked: it is past caring or already down)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        reader = sock.makefile("rb")
        reader.readline()  # greeting
        for command in ("qmp_capabilities", "quit"):
            sock.sendall(json.dumps({"execute": command}).encode() + b"\n")
            reader.readline()


_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


def _strip_terminal_codes(text: str) -> str:
    """The serial console's colours and carriage returns out, for reports."""
    return _TERMINAL_CODES.sub("", text)


def reap_stale(lab: Path = debs.LAB, keep: int = 5) -> list[str]:
    """Stop the VMs of test processes that died (by pid, checked by start time), remove
    their short directories, and keep only the newest ``keep`` run directories (console logs,
    results).  Returns what could not be cleaned."""
    problems: list[str] = []
    runs = lab / "guest" / "run"
    for record_file in sorted(runs.glob("*/vm.json")):
        try:
            record = json.loads(record_file.read_text())
            owner_pid, owner_started = record["owner"]
            qemu_pid, qemu_started = record["qemu"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host.start_time(owner_pid) == owner_started:
            continue  # its test process is alive: not ours to stop
        if host.is_alive(qemu_pid, qemu_started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(qemu_pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while host.is_alive(qemu_pid, qemu_started) and time.monotonic() < deadline:
                time.sleep(0.05)
            if host.is_alive(qemu_pid, qemu_started):
                problems.append(f"stale QEMU pid {qemu_pid} did not exit")
                continue
        record_file.unlink()
    for path, _ in shortpaths.stale("guest"):
        shutil.rmtree(path, ignore_errors=True)
    for path, _ in shortpaths.stale(guest_image.BUILD_KIND):
        guest_image.remove_build_dir(path)
    if runs.is_dir():
        finished = sorted(
            (d for d in runs.iterdir() if d.is_dir() and not (d / "vm.json").exists()),
            key=lambda d: d.stat().st_mtime,
        )
        for old in finished[:-keep] if keep else finished:
            shutil.rmtree(old, ignore_errors=True)
    return problems
