"""The guest node: a production-shaped Linux machine for the tests, as a QEMU guest.

``with Guest.boot() as g:`` builds the image if needed (guest_image.py), boots it
(guest_vm.py), waits until the agent answers and systemd has finished booting, and mounts the
host directories the tests need at the same paths as on the host:

* the checkout, read-only - the tests' Python code and the project;
* the lab, read-only (when it is not inside the checkout) - runtime binaries, images, CRI stubs;
* the test interpreter's site-packages, read-only (when not inside the checkout) - grpcio,
  protobuf and the project's dependencies: cp311 builds, which bookworm's python3.11 loads as
  they are (trixie's python3.13 finds its own builds of the compiled ones first on its path:
  guest_python.py);
* a results directory, writable - what the guest leaves for the host (logs, reports).

Same paths on both sides mean a path the host computes (a binary in the lab, a file in the
checkout) is valid in the guest as it is.  ``g.run(argv)`` runs a command, ``g.call(...)`` a
function of the test code in the guest's python3, ``g.copy_in``/``g.write``/``g.read`` move
files, ``g.kernel_topology()`` says what the guest kernel sees.  Leaving the ``with`` block
powers the guest off, and stops QEMU by pid if that does not work.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import debs, guest_image, guest_python
from .guest_channel import AgentError, Channel, ChannelError, Completed
from .guest_vm import VM, Share

# Boot budgets: a TCG boot takes 46-66 s on the project's 2-CPU machines when idle; other work
# on the machine can stretch that several times over.
BOOT_TIMEOUT = {"kvm": 180.0, "tcg": 900.0}
CALL_MARKER = "@@nri-guest-call-result@@"


class GuestError(RuntimeError):
    """The guest could not be booted, or a command in it failed; the message has the evidence
    (the command's output, the console's tail)."""


@dataclass(frozen=True)
class Topology:
    """The CPU topology as the guest kernel reports it."""

    cpus: list[int]
    socket_of: dict[int, int]
    core_of: dict[int, int]
    node_cpus: dict[int, str]  # NUMA node -> its cpulist
    thread_siblings: dict[int, str]  # CPU -> thread_siblings_list
    lscpu: str = field(repr=False)

    @property
    def sockets(self) -> int:
        return len(set(self.socket_of.values()))

    @property
    def numa_nodes(self) -> int:
        return len(self.node_cpus)

    @property
    def threads_per_core(self) -> int:
        cores: dict[tuple[int, int], int] = {}
        for cpu in self.cpus:
            key = (self.socket_of[cpu], self.core_of[cpu])
            cores[key] = cores.get(key, 0) + 1
        return max(cores.values())

    def summary(self) -> str:
        nodes = ", ".join(f"node{n}: {c}" for n, c in sorted(self.node_cpus.items()))
        cores = sorted(
            set(self.thread_siblings.values()), key=lambda s: int(re.split(r"[,-]", s)[0])
        )
        return (
            f"{len(self.cpus)} CPUs, {self.sockets} sockets, {self.numa_nodes} NUMA nodes "
            f"({nodes}), {self.threads_per_core} threads per core (siblings {' '.join(cores)})"
        )


class Guest:
    """A booted guest.  Made by :meth:`boot`; every method talks to the agent."""

    def __init__(
        self,
        vm: VM,
        channel: Channel,
        python_path: list[str],
        lab: Path,
        recipe: guest_image.Recipe = guest_image.BOOKWORM,
    ) -> None:
        self.vm = vm
        self.recipe = recipe  # which suite it runs
        self.channel = channel
        self.python_path = python_path
        self.lab = lab
        self.boot_seconds = 0.0
        self.system_state = ""

    # -- boot and shutdown -----------------------------------------------------------------

    @classmethod
    @contextmanager
    def boot(
        cls,
        *,
        lab: Path = debs.LAB,
        log: Callable[[str], None] | None = None,
        recipe: guest_image.Recipe = guest_image.BOOKWORM,
    ) -> Iterator[Guest]:
        """Build (if needed) and boot the guest of ``recipe`` (bookworm unless told); power it
        off on exit.  ``log(text)`` is told what happens (which accelerator, how long each
        step took)."""
        say = log or (lambda text: None)
        started = time.monotonic()
        cached = guest_image.cached(lab, recipe)
        image = guest_image.build(lab, of=recipe)
        if cached is None:
            say(f"{recipe.suite} image built in {time.monotonic() - started:.0f} s: {image.dir}")
        own_builds = guest_python.site_dir(recipe.python, lab)
        token = secrets.token_hex(4)
        results = lab / "guest" / "run" / token / "results"
        shares, python_path = _shares(lab, results)
        if own_builds is not None:  # before the host's site-packages (its cp311 builds)
            python_path.insert(2, str(own_builds))
        vm = VM(image, shares, lab=lab, token=token)
        say(f"guest accelerator: {vm.accel_reason}")
        channel = None
        try:
            results.mkdir(parents=True, exist_ok=True)
            vm.start()
            boot_started = time.monotonic()
            channel = Channel(vm.agent_socket)
            guest = cls(vm, channel, python_path, lab, recipe)
            guest._wait_for_agent(BOOT_TIMEOUT[vm.accel])
            guest._wait_for_systemd(BOOT_TIMEOUT[vm.accel])
            guest._mount_shares(shares)
            guest.boot_seconds = round(time.monotonic() - boot_started, 1)
            say(
                f"{recipe.suite} guest booted in {guest.boot_seconds} s ({vm.accel}), systemd says "
                f"{guest.system_state}; console log {vm.console_log}"
            )
        except BaseException as e:
            leftovers = _shutdown(vm, channel)
            if isinstance(e, Exception):
                raise GuestError(
                    f"the guest did not come up: {e}\n{vm.console_tail()}"
                    + (f"\nand stopping it left: {leftovers}" if leftovers else "")
                ) from None
            raise
        try:
            yield guest
        finally:
            if leftovers := _shutdown(vm, channel):
                raise GuestError(f"the guest could not be stopped: {leftovers}")

    def _wait_for_agent(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if (code := self.vm.exited()) is not None:
                raise GuestError(f"QEMU exited with {code} before the agent answered")
            try:
                self.channel.request("ping", 5.0)
                return
            except ChannelError as e:
                if time.monotonic() > deadline:
                    raise GuestError(f"no answer from the guest agent in {timeout} s ({e})") from e

    def _wait_for_systemd(self, timeout: float) -> None:
        """Until systemd has finished starting the boot's units; "degraded" (a unit failed)
        is reported, not fatal: the tests check what they need."""
        result = self.run(["systemctl", "is-system-running", "--wait"], timeout=timeout)
        self.system_state = result.stdout.strip()
        if self.system_state not in ("running", "degraded"):
            raise GuestError(f"systemd did not finish booting: {result.describe()}")
        if self.system_state == "degraded":
            failed = self.run(["systemctl", "--failed", "--no-legend", "--plain"], timeout=60)
            units = [line.split()[0] for line in failed.stdout.splitlines() if line.strip()]
            self.system_state += f" (failed: {' '.join(units)})"

    def _mount_shares(self, shares: list[Share]) -> None:
        for share in shares:
            if share.tag == guest_image.HARNESS_TAG:
                continue  # the agent's own unit mounted it
            options = "trans=virtio,version=9p2000.L,msize=262144"
            # Read-only trees do not change while the guest runs: let the guest cache them.
            options += ",ro,cache=loose" if share.readonly else ",rw"
            self.check(["mkdir", "-p", share.guest_path], timeout=60)
            self.check(
                ["mount", "-t", "9p", "-o", options, share.tag, share.guest_path], timeout=60
            )

    # -- commands ------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str] | str,
        *,
        timeout: float = 120.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> Completed:
        """Run a command in the guest (a string runs with ``sh -c``) and return its outcome."""
        args = ["/bin/sh", "-c", argv] if isinstance(argv, str) else list(argv)
        try:
            return self.channel.run(
                args, timeout=timeout, input=input, env=dict(env or {}), cwd=cwd
            )
        except (ChannelError, AgentError) as e:
            raise GuestError(f"{shlex.join(args)}: {e}\n{self.vm.console_tail(30)}") from None

    def check(self, argv: Sequence[str] | str, **kwargs: Any) -> str:
        """:meth:`run` that fails unless the command exits 0; returns its stdout."""
        result = self.run(argv, **kwargs)
        if not result.ok:
            raise GuestError(result.describe())
        return result.stdout

    def python_env(self) -> dict[str, str]:
        """The environment the guest's python3 runs the tests' code with."""
        return {
            "PYTHONPATH": ":".join(self.python_path),
            "PYTHONDONTWRITEBYTECODE": "1",  # the checkout is read-only in the guest
            "NRI_LAB_DIR": str(self.lab),
        }

    def call(self, function: str, timeout: float = 300.0, **kwargs: Any) -> Any:
        """``module:function(**kwargs)`` run by the guest's python3 (harness/guest_call.py);
        arguments and result are JSON.  A failure raises GuestError with the traceback."""
        result = self.run(
            ["/usr/bin/python3", "-m", "harness.guest_call", function],
            input=json.dumps(kwargs),
            env=self.python_env(),
            timeout=timeout,
        )
        _, marker, payload = result.stdout.rpartition(CALL_MARKER)
        if not result.ok or not marker:
            raise GuestError(f"{function}({kwargs}) failed in the guest\n{result.describe(6000)}")
        return json.loads(payload)

    # -- files ---------------------------------------------------------------------------

    def write(self, path: str, text: str | bytes, mode: int = 0o644) -> None:
        data = text.encode() if isinstance(text, str) else text
        try:
            self.channel.write(path, data, mode)
        except (ChannelError, AgentError) as e:
            raise GuestError(f"writing {path} in the guest: {e}") from None

    def copy_in(self, source: Path, path: str, mode: int | None = None) -> None:
        """A host file into the guest (small files: configs, units)."""
        self.write(
            path, source.read_bytes(), source.stat().st_mode & 0o7777 if mode is None else mode
        )

    def read(self, path: str) -> bytes:
        try:
            return self.channel.read(path)
        except (ChannelError, AgentError) as e:
            raise GuestError(f"reading {path} in the guest: {e}") from None

    # -- what the guest kernel says ------------------------------------------------------

    def kernel_topology(self) -> Topology:
        """CPUs, sockets, cores, NUMA nodes and thread siblings from the guest's sysfs (and
        ``lscpu``'s summary for reports)."""
        script = (
            "lscpu; echo @@; lscpu -p=CPU,CORE,SOCKET; echo @@; "
            "for n in /sys/devices/system/node/node[0-9]*; do "
            'echo "${n##*node} $(cat $n/cpulist)"; done; echo @@; '
            "for c in /sys/devices/system/cpu/cpu[0-9]*; do "
            '[ -e $c/topology ] && echo "${c##*cpu} $(cat $c/topology/thread_siblings_list)"; '
            "done"
        )
        summary, table, nodes, siblings = self.check(script, timeout=60).split("@@\n")
        socket_of, core_of = {}, {}
        for line in table.splitlines():
            if line and not line.startswith("#"):
                cpu, core, socket = map(int, line.split(","))
                socket_of[cpu], core_of[cpu] = socket, core
        return Topology(
            cpus=sorted(socket_of),
            socket_of=socket_of,
            core_of=core_of,
            node_cpus={int(n): c for n, c in (line.split() for line in nodes.splitlines())},
            thread_siblings={
                int(cpu): s for cpu, s in (line.split() for line in siblings.splitlines())
            },
            lscpu=summary,
        )

    def console_tail(self, lines: int = 60) -> str:
        return self.vm.console_tail(lines)

    @property
    def results(self) -> Path:
        """The writable directory both sides see (same path in the guest)."""
        return self.vm.dir / "results"


def _shares(lab: Path, results: Path) -> tuple[list[Share], list[str]]:
    """The directories the guest mounts (in mount order) and the guest python's path."""
    repo = debs.REPO
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    tree = [repo, lab, *map(Path, site)]
    shares = [Share(guest_image.HARNESS_TAG, repo / "tests/harness", guest_image.HARNESS_MOUNT)]
    for path in tree:  # each tree once, skipping those inside one already shared
        if not any(_inside(path, s.host_path) for s in shares[1:]):
            shares.append(Share(f"ro{len(shares)}", path, str(path)))
    shares.append(Share("results", results, str(results), readonly=False))
    return shares, [str(repo), str(repo / "tests"), *site]


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _shutdown(vm: VM, channel: Channel | None) -> list[str]:
    """Power the guest off through systemd, then make sure QEMU is gone (guest_vm.VM.stop)."""
    if channel is not None and vm.exited() is None:
        try:
            channel.run(["systemctl", "--no-block", "poweroff"], timeout=30)
            deadline = time.monotonic() + 90
            while vm.exited() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        except Exception:  # whatever happened, QEMU is stopped below
            pass
        channel.close()
    return vm.stop()
