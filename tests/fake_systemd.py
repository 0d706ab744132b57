"""A private dbus-daemon and a FAKE systemd on it, for tests and benchmarks of the D-Bus client.

This is NOT systemd: systemd cannot run as PID 1 on this host, so a small stand-in owns the name
``org.freedesktop.systemd1`` on a private ``dbus-daemon`` (the real one from Debian's
``dbus-daemon`` package, started with its own configuration in a temporary directory and
stopped by its pid) and implements the one method the product calls,
``org.freedesktop.systemd1.Manager.SetUnitProperties(s name, b runtime, a(sv) properties)`` on
``/org/freedesktop/systemd1``.  It records every call it gets (a JSON line each: unit, runtime,
the properties with their variant signatures and bytes as hex) and answers as systemd does:

* a unit whose name contains ``-gone``: ``org.freedesktop.systemd1.NoSuchUnit``, "Unit X not
  loaded." (what systemd says for a scope that was removed);
* ``-denied``: ``org.freedesktop.DBus.Error.AccessDenied`` (what polkit's refusal looks like);
* ``-oldsystemd``: ``org.freedesktop.DBus.Error.PropertyReadOnly``, "Cannot set property
  AllowedCPUs, or unknown property." (systemd before 244);
* a unit the test named with ``refuse``: ``AccessDenied`` too (a refusal that comes late when
  the fake was held or stalled meanwhile);
* anything else: an empty method return.

It is written with jeepney, an implementation independent of the product's (its wire format is
what is under test).  It can also listen on a socket of its own as a peer-to-peer D-Bus server,
the way systemd serves ``/run/systemd/private`` (no bus in between, no Hello).  A test that needs
systemd to hang stops the fake with SIGSTOP (``FakeSystemd.stall``): the bus then queues the
calls and nobody answers.

On its peer-to-peer socket it can also play ``systemctl daemon-reexec``: ``hold`` makes it read
no call (the calls queue, unread, as behind a busy systemd), and ``reexec`` closes every
connection, the unread calls lost with them, as systemd does when it re-executes; the socket
keeps listening, and new connections are served at once.  ``holds`` says what it keeps for a
unit after the calls it applied: what a ``daemon-reload`` would write into the unit's cgroup.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVICE = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
DBUS_DAEMON = "/usr/bin/dbus-daemon"

CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    {extra_policy}
  </policy>
  <!-- as on the system bus (dbus-daemon's default there, see /usr/share/dbus-1/system.conf) -->
  <limit name="max_replies_per_connection">128</limit>
  <limit name="reply_timeout">25000</limit>
</busconfig>
"""
# The bus itself refuses the call, as the system bus's policy does for a non-root sender.
DENY_SET_UNIT_PROPERTIES = (
    f'<deny send_destination="{SERVICE}" send_interface="{MANAGER}" '
    'send_member="SetUnitProperties"/>'
)


class PrivateBus:
    """A dbus-daemon of its own in a temporary directory; ``socket`` is its unix socket path."""

    def __init__(self, extra_policy: str = "") -> None:
        self.extra_policy = extra_policy
        self.dir: tempfile.TemporaryDirectory | None = None
        self.process: subprocess.Popen | None = None
        self.socket = ""
        self.address = ""

    def __enter__(self) -> PrivateBus:
        if not os.access(DBUS_DAEMON, os.X_OK):
            raise RuntimeError(f"{DBUS_DAEMON} missing: apt-get install dbus-daemon")
        self.dir = tempfile.TemporaryDirectory(prefix="nri-dbus-")
        self.socket = os.path.join(self.dir.name, "bus")
        config = Path(self.dir.name, "bus.conf")
        config.write_text(CONFIG.format(socket=self.socket, extra_policy=self.extra_policy))
        # (its warnings, e.g. that it may not raise its fd limit here, stay in its log)
        with open(os.path.join(self.dir.name, "dbus-daemon.log"), "w") as log:
            self.process = subprocess.Popen(
                [DBUS_DAEMON, f"--config-file={config}", "--nofork", "--nopidfile",
                 "--print-address=1"],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )  # fmt: skip
        self.address = self.process.stdout.readline().strip()
        if not self.address:
            self.__exit__()
            raise RuntimeError("dbus-daemon did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None


class FakeSystemd:
    """The FAKE systemd (module docstring) as a child process on ``bus``; ``calls()`` reads what
    it recorded.  ``private`` also serves a peer-to-peer socket at that path."""

    def __init__(self, bus: PrivateBus, private: str | None = None) -> None:
        self.bus = bus
        self.private = private
        self.log = Path(bus.dir.name) / "fake-systemd-calls.jsonl"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> FakeSystemd:
        argv = [sys.executable, __file__, "serve", self.bus.address, str(self.log)]
        if self.private:
            argv.append(self.private)
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.__exit__()
            raise RuntimeError(f"the FAKE systemd did not start: {line!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGCONT)  # in case a test stalled it
            _stop(self.process)
            self.process = None

    def calls(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]

    def wait_calls(self, count: int, timeout: float = 30.0) -> list[dict]:
        """The recorded calls once there are ``count`` (a failure bound, not a delay)."""
        deadline = time.monotonic() + timeout
        while True:
            calls = self.calls()
            if len(calls) >= count or time.monotonic() > deadline:
                return calls
            time.sleep(0.01)

    def refuse(self, *units: str) -> None:
        """Answer calls for these units with AccessDenied from now on."""
        (Path(self.bus.dir.name) / REFUSE).write_text(json.dumps(units))

    def hold(self) -> None:
        """Read no call on the peer-to-peer socket from now on (until ``reexec``)."""
        self._signal(signal.SIGUSR1, "held")

    def reexec(self) -> None:
        """Close every peer-to-peer connection, its unread calls lost, and serve again."""
        self._signal(signal.SIGUSR2, "reexeced")

    def _signal(self, signum: int, ack: str) -> None:
        os.kill(self.process.pid, signum)
        line = self.process.stdout.readline().strip()
        if line != ack:
            raise RuntimeError(f"the FAKE systemd answered {line!r}, not {ack!r}")

    def holds(self, unit: str, created: set[int] | None, since: int = 0) -> set[int] | None:
        """The CPUs this FAKE systemd keeps for ``unit`` after the calls it applied from call
        ``since`` on (``created``: what it held before them): the last ``AllowedCPUs`` set,
        None once released."""
        held = created
        for call in self.calls()[since:]:
            if call["unit"] != unit or not call["applied"]:
                continue
            mask = int.from_bytes(bytes.fromhex(call["properties"][0][2]), "little")
            held = {cpu for cpu in range(mask.bit_length()) if mask >> cpu & 1} or None
        return held

    def stall(self) -> None:
        """Stop answering: the process is stopped, as a hung systemd would be."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for stream in (process.stdout, process.stdin):
        if stream is not None:
            stream.close()


# --- the fake itself (runs in its own process) ----------------------------------------------


REFUSE = "fake-systemd-refuse.json"


def _answer(message, log_lock: threading.Lock, log_path: str):
    """The reply to one incoming message (None for messages that need none)."""
    from jeepney import MessageType, new_error, new_method_return

    header = message.header
    if header.message_type != MessageType.method_call:
        return None
    fields = header.fields
    from jeepney import HeaderFields

    if (fields.get(HeaderFields.interface), fields.get(HeaderFields.member)) == (
        "org.freedesktop.DBus.Peer",
        "Ping",
    ):
        return new_method_return(message)
    if (
        fields.get(HeaderFields.path) != PATH
        or fields.get(HeaderFields.interface) != MANAGER
        or fields.get(HeaderFields.member) != "SetUnitProperties"
    ):
        return new_error(
            message, "org.freedesktop.DBus.Error.UnknownMethod", "s", ("no such method",)
        )
    if fields.get(HeaderFields.signature) != "sba(sv)":
        return new_error(message, "org.freedesktop.DBus.Error.InvalidArgs", "s", ("bad signature",))
    unit, runtime, properties = message.body
    reply = _reply_to(message, unit, Path(log_path).parent / REFUSE)
    entry = {
        "unit": unit,
        "runtime": runtime,
        "properties": [
            [name, signature, value.hex() if isinstance(value, bytes) else value]
            for name, (signature, value) in properties
        ],
        "serial": header.serial,
        "applied": reply.header.message_type == MessageType.method_return,
    }
    with log_lock, open(log_path, "a") as log:
        log.write(json.dumps(entry) + "\n")
    return reply


def _reply_to(message, unit: str, refuse: Path):
    from jeepney import new_error, new_method_return

    if "-gone" in unit:
        return new_error(
            message, "org.freedesktop.systemd1.NoSuchUnit", "s", (f"Unit {unit} not loaded.",)
        )
    if "-denied" in unit or (refuse.exists() and unit in json.loads(refuse.read_text())):
        return new_error(
            message, "org.freedesktop.DBus.Error.AccessDenied", "s", ("Access denied",)
        )
    if "-oldsystemd" in unit:
        return new_error(
            message,
            "org.freedesktop.DBus.Error.PropertyReadOnly",
            "s",
            ("Cannot set property AllowedCPUs, or unknown property.",),
        )
    return new_method_return(message)


class Gate:
    """Whether the peer-to-peer connections may read their calls, and their re-executions."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.held = False
        self.generation = 0  # one more at each re-exec: older connections are closed
        self.conns: set = set()

    def hold(self, *_: object) -> None:
        with self.cond:
            self.held = True
        print("held", flush=True)

    def reexec(self, *_: object) -> None:
        import socket

        with self.cond:
            self.generation += 1
            self.held = False
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self.conns.clear()
            self.cond.notify_all()
        print("reexeced", flush=True)

    def may_read(self, generation: int) -> bool:
        """Wait while held; False once the connection's systemd has re-executed."""
        with self.cond:
            self.cond.wait_for(lambda: not self.held or self.generation != generation)
            return self.generation == generation


def _serve_private(path: str, log_lock: threading.Lock, log_path: str, gate: Gate) -> None:
    """Peer-to-peer D-Bus on ``path``, as systemd's /run/systemd/private: SASL EXTERNAL by hand,
    then messages, no bus and no Hello."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)

    def connection(conn: socket.socket) -> None:
        with gate.cond:
            generation = gate.generation
            gate.conns.add(conn)
        with contextlib.suppress(OSError):  # the client went away
            converse(conn, generation)

    def converse(conn: socket.socket, generation: int) -> None:
        from jeepney import Parser

        with conn:
            data = b""
            while b"\r\n" not in data:  # the AUTH line: answered at once, as sd-bus does
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
            while b"BEGIN\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            rest = data.split(b"BEGIN\r\n", 1)[1]
            parser = Parser()
            serial = 0
            pending = rest
            while True:
                if pending and not gate.may_read(generation):
                    return  # re-executed: what was not read yet is lost
                for message in parser.feed(pending):
                    reply = _answer(message, log_lock, log_path)
                    if reply is not None:
                        serial += 1
                        conn.sendall(reply.serialise(serial=serial))
                pending = conn.recv(65536)
                if not pending:
                    return

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=connection, args=(conn,), daemon=True).start()


def serve(address: str, log_path: str, private: str | None) -> None:
    from jeepney.bus_messages import message_bus
    from jeepney.io.blocking import open_dbus_connection

    log_lock = threading.Lock()
    gate = Gate()
    signal.signal(signal.SIGUSR1, gate.hold)
    signal.signal(signal.SIGUSR2, gate.reexec)
    connection = open_dbus_connection(bus=address)
    reply = connection.send_and_get_reply(message_bus.RequestName(SERVICE, 0))
    if reply.body != (1,):  # DBUS_REQUEST_NAME_REPLY_PRIMARY_OWNER
        print(f"RequestName answered {reply.body}", flush=True)
        return
    if private:
        threading.Thread(
            target=_serve_private, args=(private, log_lock, log_path, gate), daemon=True
        ).start()
        while not os.path.exists(private):
            time.sleep(0.001)
    print("ready", flush=True)
    while True:
        message = connection.receive()
        reply = _answer(message, log_lock, log_path)
        if reply is not None:
            connection.send(reply)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
