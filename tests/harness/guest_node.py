"""The guest as a Kubernetes node: its runtimes (guest_runtimes.py) installed as systemd units,
one of them running at a time with kubelet's slices in place (guest_kubelet.py), and the
project's daemon installed as packaging/ ships it.

``node.use("containerd-2.3")`` makes that runtime the node's runtime: the previous one's pods
are removed and it is stopped, the new one is started by systemd, waited for until CRI answers,
and given the lab's images.  ``node.start_daemon()`` installs and starts ``nri-cpuplugin run``
as ``nri-cpuplugin.service`` - packaging/systemd's unit as shipped, with a drop-in that runs it
from the shared checkout - and waits until it has synchronized with the runtime.
"""

from __future__ import annotations

import json
import shlex
import time

from . import debs
from .guest import Guest, GuestError
from .guest_runtimes import (
    EMULATED_NRI_TIMEOUTS,
    HOOK_PROGRAM,
    GuestRuntime,
    NRITimeouts,
    for_recipe,
    runtimes,
)

DAEMON_UNIT = "nri-cpuplugin.service"
DAEMON_STATE = "/var/lib/nri-cpuplugin"
DAEMON_START_TIMEOUT = 600  # seconds, under emulation (the unit's own is 2 min)
PACKAGING = debs.REPO / "packaging"


class GuestNode:
    def __init__(
        self, guest: Guest, nri: NRITimeouts | None = None, runc: str | None = None
    ) -> None:
        """``runc``: what the runtimes run as runc (default the guest's: the bookworm image's
        1.1.5, the lab's 1.3.6 on trixie; a benchmark names its counting wrapper, which it
        writes into the guest itself).  CRI-O runs crun on trixie (guest_runtimes.py)."""
        self.guest = guest
        emulated = guest.vm.accel == "tcg"
        self.nri = nri or (EMULATED_NRI_TIMEOUTS if emulated else NRITimeouts())
        oci = for_recipe(guest.recipe, guest.lab)
        self.runtimes = runtimes(guest.lab, self.nri, runc or oci.runc, oci.crun)
        self.current: GuestRuntime | None = None
        self.daemon_running = False  # started by start_daemon(), not stopped since
        self.started_at = ""  # the journal's cursor before the last start_daemon()
        self._installed = False
        self._images: set[str] = set()

    # -- runtimes ------------------------------------------------------------------------

    def install(self) -> None:
        """Every runtime's configuration and unit, and the daemon's, written once."""
        if self._installed:
            return
        for runtime in self.runtimes.values():
            for path, text in runtime.files.items():
                self.guest.write(path, text)
        self._install_daemon()
        self._install_hook()
        self.guest.check(["systemctl", "daemon-reload"], timeout=120)
        self._installed = True

    def use(self, name: str) -> GuestRuntime:
        """Make ``name`` the node's running runtime (see the module docstring)."""
        runtime = self.runtimes[name]
        self.install()
        if self.current is not None and self.current.name != name:
            self.clear()
        if not self.active(runtime.unit):
            if not runtime.images_while_running:
                self._import_images(runtime)
            started = self.guest.run(["systemctl", "start", runtime.unit], timeout=300)
            if not started.ok:
                raise GuestError(
                    f"{runtime.unit} did not start: {started.describe()}\n{self.log(runtime)}"
                )
        self.current = runtime
        try:
            self.guest.call("harness.guest_kubelet:wait_ready", address=runtime.cri_socket)
            if runtime.images_while_running:
                self._import_images(runtime)
            self.guest.call("harness.guest_kubelet:ensure_kubepods")
        except GuestError as e:
            raise GuestError(f"{runtime.name} is not usable: {e}\n{self.log(runtime)}") from None
        return runtime

    def _import_images(self, runtime: GuestRuntime) -> None:
        # Keyed by the CRI socket: crio and crio-hooks share one image store.
        if runtime.cri_socket in self._images:
            return
        for command in runtime.import_images:
            for _ in range(3):
                result = self.guest.run(list(command), timeout=300)
                # ctr's dial deadline can pass while a just-started runtime is still busy
                # under emulation ("failed to dial ... context deadline exceeded"): again.
                if result.ok or "failed to dial" not in result.stderr:
                    break
                time.sleep(2)
            if not result.ok:
                raise GuestError(f"importing images into {runtime.name}: {result.describe()}")
        self._images.add(runtime.cri_socket)

    def placing(self, name: str) -> GuestRuntime:
        """``name`` as the node's runtime with the project placing its containers: the daemon
        for a runtime with NRI, the OCI hook (in the runtime's hooks.d) for ``crio-hooks``.
        What an earlier call set up is kept (a daemon start under emulation takes tens of
        seconds); another runtime is switched to, and the daemon started or stopped."""
        previous = self.current
        runtime = self.use(name)
        if not runtime.nri:
            self.stop_daemon()
        elif previous is not runtime or not self.daemon_running or not self.active(DAEMON_UNIT):
            self.start_daemon()
        return runtime

    def clear(self) -> list[str]:
        """Every pod of the current runtime removed (and its slice stopped); the daemon
        stopped and its state removed, so the next runtime starts from a clean node."""
        errors: list[str] = []
        if self.current is not None and self.active(self.current.unit):
            errors = self.guest.call(
                "harness.guest_kubelet:remove_all", address=self.current.cri_socket
            )
        self.stop_daemon()
        return errors

    def active(self, unit: str) -> bool:
        return self.guest.run(["systemctl", "is-active", "--quiet", unit], timeout=60).ok

    def log(self, runtime: GuestRuntime | None = None, lines: int = 60) -> str:
        """The tail of a runtime's journal (default: the current one)."""
        runtime = runtime or self.current
        if runtime is None:
            return "(no runtime started)"
        return self.journal(runtime.unit, lines)

    def journal(self, unit: str, lines: int = 60) -> str:
        result = self.guest.run(
            ["journalctl", "--no-pager", "-o", "short-monotonic", "-u", unit, "-n", str(lines)],
            timeout=60,
        )
        text = result.stdout.splitlines()
        text = [line if len(line) <= 1000 else line[:1000] + " [...]" for line in text]
        return f"--- journal of {unit}, last {len(text)} lines ---\n" + "\n".join(text)

    # -- the project's daemon ------------------------------------------------------------

    def _install_daemon(self) -> None:
        unit_dir = "/etc/systemd/system"
        self.guest.copy_in(PACKAGING / "systemd" / DAEMON_UNIT, f"{unit_dir}/{DAEMON_UNIT}", 0o644)
        self.guest.copy_in(PACKAGING / "config.toml", "/etc/nri-cpuplugin/config.toml", 0o644)
        # packaging's optional drop-in for pods that keep their CPUs free of interrupts
        # (tests/guest/test_irq.py): without it the unit's sandbox hides /proc/irq.
        irq = PACKAGING / "systemd" / f"{DAEMON_UNIT}.d" / "irq.conf"
        self.guest.copy_in(irq, f"{unit_dir}/{DAEMON_UNIT}.d/irq.conf", 0o644)
        environment = " ".join(shlex.quote(f"{k}={v}") for k, v in self.guest.python_env().items())
        runtimes_units = " ".join(r.unit for r in self.runtimes.values())
        # Under emulation (about 10x slower) the unit's start - which waits for the plugin's
        # registration, Type=notify - and its watchdog get the slack the NRI timeouts get.
        slack = (
            f"TimeoutStartSec={DAEMON_START_TIMEOUT}s\nWatchdogSec=5min\n"
            if self.guest.vm.accel == "tcg"
            else ""
        )
        # Only what differs on this node: the program comes from the shared checkout, run by
        # the guest's python3 with the host's site-packages (guest.py), and the runtimes'
        # units have other names than packaging's containerd.service / crio.service.
        self.guest.write(
            f"{unit_dir}/{DAEMON_UNIT}.d/guest-node.conf",
            f"""\
# Written by tests/harness/guest_node.py.
[Unit]
After={runtimes_units}

[Service]
Environment={environment}
ExecStart=
ExecStart=/usr/bin/python3 -m nri_cpuplugin.cli run --config /etc/nri-cpuplugin/config.toml
{slack}{_sandbox_exceptions(self.guest.python_path)}""",
        )

    def _install_hook(self) -> None:
        """The OCI hook's program where hooks/*.json name it: a launcher of the shared
        checkout's ``nri-cpuplugin-hook`` with the daemon's configuration file."""
        environment = "".join(
            f"export {k}={shlex.quote(v)}\n" for k, v in self.guest.python_env().items()
        )
        self.guest.write(
            HOOK_PROGRAM,
            f"""#!/bin/sh
# Written by tests/harness/guest_node.py: the project's OCI hook from the shared checkout.
{environment}exec /usr/bin/python3 -c \
  'import sys; from nri_cpuplugin.hook.entry import main; sys.exit(main())' \
  --config /etc/nri-cpuplugin/config.toml "$@"
""",
            0o755,
        )

    def start_daemon(self, timeout: float = 300.0) -> None:
        """(Re)start the daemon with an empty state directory; wait for its Synchronize.
        ``started_at``: the journal's cursor before the start, for a test to judge only the
        records of this daemon (``daemon_records(after=...)``)."""
        self.install()
        self.stop_daemon()
        self.started_at = cursor = self._journal_cursor()
        # Type=notify: systemctl returns once the daemon registered with the runtime.
        started = self.guest.run(
            ["systemctl", "start", DAEMON_UNIT], timeout=DAEMON_START_TIMEOUT + 60
        )
        if not started.ok:
            raise GuestError(f"{DAEMON_UNIT} did not start: {started.describe()}")
        deadline = time.monotonic() + timeout
        while not self.daemon_records("synchronize", after=cursor):
            if time.monotonic() > deadline or not self.active(DAEMON_UNIT):
                raise GuestError(
                    f"the daemon did not synchronize with {self.current and self.current.name} "
                    f"in {timeout} s\n{self.journal(DAEMON_UNIT)}\n{self.log()}"
                )
            time.sleep(1)
        self.daemon_running = True

    def stop_daemon(self) -> None:
        self.daemon_running = False
        self.guest.run(["systemctl", "stop", DAEMON_UNIT], timeout=120)
        self.guest.run(["rm", "-rf", DAEMON_STATE], timeout=60)

    def _journal_cursor(self) -> str:
        out = self.guest.run(["journalctl", "--show-cursor", "-n", "0", "-q"], timeout=60).stdout
        return out.strip().removeprefix("-- cursor: ")

    def daemon_records(self, action: str | None = None, after: str | None = None) -> list[dict]:
        """The daemon's audit records in the journal (``ACTION=...``), oldest first."""
        # Filtered here, not by journalctl: systemd 252's journalctl finds nothing when
        # --after-cursor is combined with field matches the cursor's own entry lacks.
        argv = ["journalctl", "--no-pager", "-o", "json"]
        argv += [f"--after-cursor={after}"] if after else ["SYSLOG_IDENTIFIER=nri-cpuplugin"]
        out = self.guest.run(argv, timeout=60).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return [
            r
            for r in records
            if r.get("SYSLOG_IDENTIFIER") == "nri-cpuplugin"
            and (action is None or r.get("ACTION") == action)
        ]

    def status(self) -> dict:
        """``nri-cpuplugin status --json`` in the guest."""
        done = self.guest.run(
            ["/usr/bin/python3", "-m", "nri_cpuplugin.cli", "status", "--json"],
            env=self.guest.python_env(),
            timeout=120,
        )
        # 0, or the daemon's health (3 not running, 4 not connected, 5 stale; the report
        # says which): 1 and 2 (no state, bad usage) are failures here.
        if done.timed_out or done.rc not in (0, 3, 4, 5):
            raise GuestError(done.describe())
        return json.loads(done.stdout)


def _sandbox_exceptions(python_path: list[str]) -> str:
    """What the unit's sandbox must let through so that the daemon finds its code in the
    shared checkout: an installed daemon lives under /usr, a checkout may be anywhere - in a
    ``mktemp -d`` directory (hidden by ``PrivateTmp=yes``) or a home directory (hidden by
    ``ProtectHome=yes``).  Only the setting that hides it is relaxed, and only then."""
    lines = []
    if any(p.startswith(("/tmp/", "/var/tmp/")) for p in python_path):
        lines.append("# The checkout is under a temporary directory.\nPrivateTmp=no")
    if any(p.startswith(("/home/", "/root/", "/run/user/")) for p in python_path):
        lines.append("# The checkout is under a home directory.\nProtectHome=no")
    return "".join(f"{line}\n" for line in lines)
