"""D-Bus clients for systemd's unit properties, side by side: ours and three libraries.

What the systemd cgroup driver makes the product pay (nri_cpuplugin/hardware/systemd/):
the OCI hook imports a D-Bus client, connects to the system bus (authentication and Hello) and
sends one or more ``SetUnitProperties`` calls on every container start; the daemon keeps a
connection and pipelines one call per shared container when an exclusive one starts.  So the
candidates are measured on those three costs, in one run, their samples interleaved round by
round so that the machine's noise falls on all of them alike:

* **import**: the wall time of ``python -I -S -c 'import X'`` as the hook's launcher starts
  Python (``-I -S``, the package's directory appended to ``sys.path``), next to the same start
  importing nothing; and the sum of ``-X importtime``'s self times over the statement.
* **connect**: connect, authenticate, Hello answered, close (sdbus completes its handshake
  only with the first call: see the next figure).
* **fresh connection + first call**: connect, authenticate, Hello, one ``SetUnitProperties``
  answered, close - the hook's whole D-Bus exchange for one container.
* **call** on an open connection, one at a time, and **100 pipelined calls** (all sent, then
  every answer awaited): the daemon's case.  *Client CPU* is the benchmark process's CPU time
  per call (``time.process_time``), the part of each figure that is the client's own work.

The peer is a real ``dbus-daemon`` (Debian's, a private instance with the system bus's limits) with
a FAKE systemd on it (tests/fake_systemd.py: systemd cannot run as PID 1 here), which answers every
call; ours is also measured on the FAKE's peer-to-peer socket, the way systemd's
``/run/systemd/private`` is reached (no bus in between, no Hello).  Candidates: ours
(``hardware/systemd/client.py`` on the sans-I/O ``conversation.py``, ``wire.py`` and
``unmarshal.py``), jeepney (pure Python, blocking API), dbus-fast (Cython, asyncio only) and sdbus
(libsystemd's sd-bus, blocking calls; its pipelining through its asyncio API).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fake_systemd import MANAGER, PATH, SERVICE, FakeSystemd, PrivateBus

from nri_cpuplugin.hardware.systemd import units as systemd_units
from nri_cpuplugin.hardware.systemd.client import SystemdClient

from .stats import percentile, summary

ROOT = Path(__file__).resolve().parents[2]
SITE = next(p for p in sys.path if p.endswith("site-packages"))
# What each candidate's user imports to make the call (dbus-fast has no blocking API: asyncio).
IMPORTS = {
    "ours": "import nri_cpuplugin.hardware.systemd.client",  # what the OCI hook imports
    "jeepney": "import jeepney, jeepney.io.blocking",
    "dbus-fast": "import dbus_fast.aio",
    "sdbus": "import sdbus",
}
HOOK_LOADED = "import os, struct, nri_cpuplugin.base.errors"
UNIT = "cri-containerd-0123456789abcdef.scope"
CPUS, MEMS = (1, 2, 3, 9), (0,)
PIPELINED = 100


def _program(statement: str) -> str:
    # as hook/launcher.py starts the hook: -I -S, then the package's directory on sys.path
    return f"import sys; sys.path += [{str(ROOT)!r}, {SITE!r}]; {statement}"


def bench_imports(rounds: int) -> dict[str, Any]:
    """Wall time of ``python -I -S -c`` importing each candidate, and bare; importtime sums."""
    programs = {"bare": _program("pass"), **{k: _program(v) for k, v in IMPORTS.items()}}
    # what the hook's own path has loaded before it would need the client: ours costs it only
    # its two modules (the others load no module of the hook's)
    programs["hook"] = _program(HOOK_LOADED)
    programs["ours, in the hook"] = _program(f"{HOOK_LOADED}; {IMPORTS['ours']}")
    wall: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(3):  # warm the page cache and the bytecode caches
        for program in programs.values():
            subprocess.run([sys.executable, "-I", "-S", "-c", program], check=True)
    for _ in range(rounds):
        for name, program in programs.items():
            started = time.perf_counter()
            subprocess.run([sys.executable, "-I", "-S", "-c", program], check=True)
            wall[name].append(time.perf_counter() - started)
    # -X importtime: a line per module, "self [us] | cumulative | name"; a program's figure is
    # the sum of self times of the modules its base program does not load
    runs: dict[str, list[dict[str, int]]] = {name: [] for name in programs}
    for _ in range(max(10, rounds // 2)):
        for name, program in programs.items():
            proc = subprocess.run(
                [sys.executable, "-X", "importtime", "-I", "-S", "-c", program],
                capture_output=True,
                text=True,
                check=True,
            )
            modules = {}
            for line in proc.stderr.splitlines():
                if line.startswith("import time:") and "|" in line:
                    cells = line.split(":", 1)[1].split("|")
                    if cells[0].strip().isdigit():
                        modules[cells[2].strip()] = int(cells[0])
            runs[name].append(modules)

    def base(name: str) -> str:  # each program against the start it adds to
        return "hook" if name == "ours, in the hook" else "bare"

    loaded = {name: set().union(*samples) for name, samples in runs.items()}

    return {
        "wall": {name: summary(samples) for name, samples in wall.items()},
        "ratio": {
            name: {
                "median": percentile(samples, 50) / percentile(wall[base(name)], 50),
                "p99": percentile(samples, 99) / percentile(wall[base(name)], 99),
            }
            for name, samples in wall.items()
        },
        "importtime_ms": {
            name: percentile(
                [
                    sum(us for module, us in run.items() if module not in loaded[base(name)])
                    for run in samples
                ],
                50,
            )
            / 1e3
            for name, samples in runs.items()
        },
        "rounds": rounds,
    }


# --- the candidates' calls --------------------------------------------------------------------


def _mask(ids: tuple[int, ...]) -> bytes:
    return systemd_units.cpu_mask(ids)


class _Ours:
    def __init__(self, path: str, hello: bool) -> None:
        self.path, self.hello = path, hello
        self.client: SystemdClient | None = None

    def fresh(self) -> None:
        with SystemdClient(self.path, hello=self.hello) as client:
            _check(client.set_allowed([(UNIT, CPUS, MEMS)], 5.0))

    def connect(self) -> None:
        with SystemdClient(self.path, hello=self.hello) as client:
            error = client.connect(5.0)
            if error is not None:
                raise error

    def open(self) -> None:
        self.client = SystemdClient(self.path, hello=self.hello)

    def call(self) -> None:
        _check(self.client.set_allowed([(UNIT, CPUS, MEMS)], 5.0))

    def pipelined(self) -> None:
        changes = [(f"crio-{i:064x}.scope", CPUS, MEMS) for i in range(PIPELINED)]
        _check(self.client.set_allowed(changes, 10.0))

    def close(self) -> None:
        self.client.close()


def _check(results: list[systemd_units.UnitResult]) -> None:
    bad = [r for r in results if r.outcome != systemd_units.SET]
    if bad:
        raise RuntimeError(f"calls failed: {bad[:3]}")


class _Jeepney:
    def __init__(self, address: str) -> None:
        from jeepney import DBusAddress

        self.address = address
        self.target = DBusAddress(PATH, bus_name=SERVICE, interface=MANAGER)
        self.conn = None

    def _message(self, unit: str):
        from jeepney import new_method_call

        properties = [
            ("AllowedCPUs", ("ay", _mask(CPUS))),
            ("AllowedMemoryNodes", ("ay", _mask(MEMS))),
        ]
        return new_method_call(
            self.target, "SetUnitProperties", "sba(sv)", (unit, True, properties)
        )

    def fresh(self) -> None:
        from jeepney.io.blocking import open_dbus_connection

        with open_dbus_connection(bus=self.address) as conn:
            _jeepney_ok(conn.send_and_get_reply(self._message(UNIT), timeout=5))

    def connect(self) -> None:
        from jeepney.io.blocking import open_dbus_connection

        open_dbus_connection(bus=self.address).close()  # (it says Hello before returning)

    def open(self) -> None:
        from jeepney.io.blocking import open_dbus_connection

        self.conn = open_dbus_connection(bus=self.address)

    def call(self) -> None:
        _jeepney_ok(self.conn.send_and_get_reply(self._message(UNIT), timeout=5))

    def pipelined(self) -> None:
        from jeepney import MessageType

        for i in range(PIPELINED):
            self.conn.send(self._message(f"crio-{i:064x}.scope"))
        answered = 0
        while answered < PIPELINED:
            reply = self.conn.receive(timeout=10)
            if reply.header.message_type in (MessageType.method_return, MessageType.error):
                _jeepney_ok(reply)
                answered += 1

    def close(self) -> None:
        self.conn.close()


def _jeepney_ok(reply) -> None:
    from jeepney import MessageType

    if reply.header.message_type != MessageType.method_return:
        raise RuntimeError(f"jeepney call failed: {reply.body}")


class _DBusFast:
    def __init__(self, address: str, loop: asyncio.AbstractEventLoop) -> None:
        self.address, self.loop = address, loop
        self.bus = None

    def _message(self, unit: str):
        from dbus_fast import Message, Variant

        properties = [
            ["AllowedCPUs", Variant("ay", _mask(CPUS))],
            ["AllowedMemoryNodes", Variant("ay", _mask(MEMS))],
        ]
        return Message(
            destination=SERVICE,
            path=PATH,
            interface=MANAGER,
            member="SetUnitProperties",
            signature="sba(sv)",
            body=[unit, True, properties],
        )

    async def _connect(self):
        from dbus_fast.aio import MessageBus

        return await MessageBus(bus_address=self.address).connect()

    def fresh(self) -> None:
        async def run() -> None:
            bus = await self._connect()
            _fast_ok(await bus.call(self._message(UNIT)))
            bus.disconnect()
            await bus.wait_for_disconnect()

        self.loop.run_until_complete(run())

    def connect(self) -> None:
        async def run() -> None:
            bus = await self._connect()  # (Hello answered before it returns)
            bus.disconnect()
            await bus.wait_for_disconnect()

        self.loop.run_until_complete(run())

    def open(self) -> None:
        self.bus = self.loop.run_until_complete(self._connect())

    def call(self) -> None:
        _fast_ok(self.loop.run_until_complete(self.bus.call(self._message(UNIT))))

    def pipelined(self) -> None:
        async def run() -> None:
            calls = [self.bus.call(self._message(f"crio-{i:064x}.scope")) for i in range(PIPELINED)]
            for reply in await asyncio.gather(*calls):
                _fast_ok(reply)

        self.loop.run_until_complete(run())

    def close(self) -> None:
        self.bus.disconnect()
        self.loop.run_until_complete(self.bus.wait_for_disconnect())


def _fast_ok(reply) -> None:
    from dbus_fast import MessageType

    if reply.message_type != MessageType.METHOD_RETURN:
        raise RuntimeError(f"dbus-fast call failed: {reply.body}")


class _SdBus:
    """libsystemd's sd-bus: sd_bus_open_system() honours DBUS_SYSTEM_BUS_ADDRESS."""

    def __init__(self, address: str, loop: asyncio.AbstractEventLoop) -> None:
        self.address, self.loop = address, loop
        self.bus = None

    def _bus(self):
        import sdbus

        os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = self.address
        return sdbus.sd_bus_open_system()

    def _message(self, bus, unit: str):
        message = bus.new_method_call_message(SERVICE, PATH, MANAGER, "SetUnitProperties")
        properties = [
            ("AllowedCPUs", ("ay", _mask(CPUS))),
            ("AllowedMemoryNodes", ("ay", _mask(MEMS))),
        ]
        message.append_data("sba(sv)", unit, True, properties)
        return message

    def fresh(self) -> None:
        bus = self._bus()
        bus.call(self._message(bus, UNIT))
        bus.close()

    def open(self) -> None:
        self.bus = self._bus()

    def call(self) -> None:
        self.bus.call(self._message(self.bus, UNIT))

    def pipelined(self) -> None:
        async def run() -> None:
            calls = [
                self.bus.call_async(self._message(self.bus, f"crio-{i:064x}.scope"))
                for i in range(PIPELINED)
            ]
            await asyncio.gather(*calls)

        self.loop.run_until_complete(run())

    def close(self) -> None:
        self.bus.close()


# --- measuring --------------------------------------------------------------------------------


def _timed(operation: Callable[[], None]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    operation()
    return time.perf_counter() - wall, time.process_time() - cpu


def _interleaved(
    sides: dict[str, Callable[[], None]], rounds: int, per_op: int = 1
) -> dict[str, dict[str, Any]]:
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for operation in sides.values():  # warm-up
        for _ in range(3):
            operation()
    for _ in range(rounds):
        for name, operation in sides.items():
            elapsed, spent = _timed(operation)
            wall[name].append(elapsed)
            cpu[name].append(spent / per_op)
    return {
        name: {**summary(wall[name]), "cpu_per_call_ms": percentile(cpu[name], 50) * 1e3}
        for name in sides
    }


def bench_dbus_clients(rounds: int = 200, import_rounds: int = 40) -> dict[str, Any]:
    """Every figure of the module docstring, for every candidate, in one run.
    Returns {"imports": bench_imports(...), "connect", "fresh", "call", "pipelined": {side:
    summary + cpu_per_call_ms}, "rounds", "pipelined_calls"}."""
    imports = bench_imports(import_rounds)
    loop = asyncio.new_event_loop()
    try:
        with PrivateBus() as bus:
            private = os.path.join(bus.dir.name, "private")
            with FakeSystemd(bus, private=private):
                clients = {
                    "ours": _Ours(bus.socket, hello=True),
                    "ours, peer to peer": _Ours(private, hello=False),
                    "jeepney": _Jeepney(bus.address),
                    "dbus-fast": _DBusFast(bus.address, loop),
                    "sdbus": _SdBus(bus.address, loop),
                }
                connect = _interleaved(
                    {name: c.connect for name, c in clients.items() if hasattr(c, "connect")},
                    rounds,
                )
                fresh = _interleaved(
                    {name: c.fresh for name, c in clients.items() if hasattr(c, "fresh")}, rounds
                )
                for client in clients.values():
                    client.open()
                try:
                    call = _interleaved({name: c.call for name, c in clients.items()}, rounds)
                    pipelined = _interleaved(
                        {name: c.pipelined for name, c in clients.items()},
                        max(10, rounds // 10),
                        PIPELINED,
                    )
                finally:
                    for client in clients.values():
                        client.close()
    finally:
        loop.close()
    return {
        "imports": imports,
        "connect": connect,
        "fresh": fresh,
        "call": call,
        "pipelined": pipelined,
        "rounds": rounds,
        "pipelined_calls": PIPELINED,
    }


if __name__ == "__main__":
    import json

    print(
        json.dumps(bench_dbus_clients(int(sys.argv[1]) if len(sys.argv) > 1 else 50, 20), indent=1)
    )
