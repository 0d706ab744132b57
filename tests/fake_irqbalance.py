"""A FAKE irqbalance for tests: its control socket (one request per connection: ``settings cpus
<list>`` replaces its banned set, ``settings cpus NULL`` returns to the one it started with),
its ``/proc/<pid>/environ`` as systemd starts it (the unit's environment, then our environment
file, which the drop-in of packaging/ loads after it), and the banned set it would use, in its
own order of precedence (docs/cgroups-and-hooks.md section 22).  Unlike the real one it does
nothing with its banned set: tests ask for it (``banned``).

A unix socket's path must stay under 108 bytes: the tree goes below ``short_root()``, not a
test's (long) tmp_path.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nri_cpuplugin.core.cpuset import CPUSet
from nri_cpuplugin.hardware.interrupts.affinity import parse_mask

REQUEST = "settings cpus "


@contextmanager
def short_root() -> Iterator[Path]:
    """A fresh directory with a short path (removed afterwards)."""
    root = tempfile.mkdtemp(prefix="irqb-")  # the system temp dir: short, unlike pytest's
    try:
        yield Path(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class FakeIrqbalance:
    """irqbalance running beside a generated sysfs: /proc, /run next to it, as the daemon
    finds them (hardware/interrupts/keeper.py ``Roots.beside``)."""

    def __init__(self, sysfs: Path, unit_env: dict[str, str] | None = None) -> None:
        top = sysfs.parent
        self.sysfs = sysfs
        self.proc = top / "proc"
        self.sockets = top / "run" / "irqbalance"
        self.ours = top / "run" / "nri-cpuplugin" / "irqbalance.env"
        self.unit_env = dict(unit_env or {})
        self.pid = 1000
        self.environ: dict[str, str] = {}
        self.from_socket: str | None = None
        self.requests: list[str] = []
        self._sock: socket.socket | None = None
        self.start()

    def start(self) -> None:
        """``systemctl restart irqbalance``: a new pid, the environment read again."""
        self.stop()
        self.pid += 1
        self.environ = dict(self.unit_env)
        if self.ours.exists():
            lines = self.ours.read_text().splitlines()
            self.environ.update(line.split("=", 1) for line in lines if "=" in line)
        (self.proc / str(self.pid)).mkdir(parents=True)
        environ = "".join(f"{key}={value}\0" for key, value in self.environ.items())
        (self.proc / str(self.pid) / "environ").write_bytes(environ.encode())
        self.sockets.mkdir(parents=True, exist_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self._path))
        self._sock.listen(16)
        self._sock.setblocking(False)
        self.from_socket = None

    def stop(self) -> None:
        if self._sock is None:
            return
        self._serve()
        self._sock.close()
        self._sock = None
        self._path.unlink(missing_ok=True)
        shutil.rmtree(self.proc / str(self.pid), ignore_errors=True)

    def banned(self) -> CPUSet:
        """The CPUs it keeps interrupts off now (a list that names CPUs this machine does not
        have is taken as written: they exist nowhere)."""
        self._serve()
        if self.from_socket is not None:
            return CPUSet.parse(self.from_socket)
        if self.environ.get("IRQBALANCE_BANNED_CPUS"):
            return parse_mask(self.environ["IRQBALANCE_BANNED_CPUS"])
        if self.environ.get("IRQBALANCE_BANNED_CPULIST"):
            return CPUSet.parse(self.environ["IRQBALANCE_BANNED_CPULIST"])
        found = CPUSet()
        for name in ("isolated", "nohz_full"):
            path = self.sysfs / "devices" / "system" / "cpu" / name
            if path.exists():
                found |= CPUSet.parse(path.read_text().strip())
        return found

    @property
    def _path(self) -> Path:
        return self.sockets / f"irqbalance{self.pid}.sock"

    def _serve(self) -> None:
        """The requests sent meanwhile (each client connected, sent and closed)."""
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            try:
                conn.setblocking(True)
                request = conn.recv(4096).decode()
            finally:
                conn.close()
            self.requests.append(request)
            if request.startswith(REQUEST):
                word = request[len(REQUEST) :].split(" ")[0]
                self.from_socket = None if word.startswith("NULL") else word
